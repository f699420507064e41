"""Services some tests need from the machine (Chromium and ChromeDriver, redis-server, SGLang's
and vLLM's routers): where one is missing its tests skip with the reason, unless the run requires
it.

``MLX_KVSERVER_REQUIRE`` (a comma-separated list: ``chromium``, ``redis-server``,
``sglang-router``, ``vllm-router``) names what a run requires; ``.ci/run`` sets it after installing them, so a CI
run whose browser or store went missing fails instead of looking green with those tests skipped.
"""

from __future__ import annotations

import os
from typing import NoReturn

SERVICES = ("chromium", "redis-server", "sglang-router", "vllm-router")


def required() -> set[str]:
    """The services this run requires (``MLX_KVSERVER_REQUIRE``); an unknown name is an error."""
    names = {n.strip() for n in os.environ.get("MLX_KVSERVER_REQUIRE", "").split(",") if n.strip()}
    unknown = names - set(SERVICES)
    if unknown:
        raise ValueError(f"MLX_KVSERVER_REQUIRE names {sorted(unknown)}; known: {SERVICES}")
    return names


def unavailable(service: str, reason: str) -> NoReturn:
    """Skip the test for ``reason``, or fail it where this run requires ``service``."""
    import pytest  # here, not at the top: benchmarks import the harness and need no pytest

    if service in required():
        pytest.fail(f"{reason}; this run requires {service} (MLX_KVSERVER_REQUIRE)",
                    pytrace=False)
    pytest.skip(reason)
