"""Shared fixtures: a tiny random-weight model folder and loaded models (no network).

Property tests are deterministic: hypothesis draws the same examples on every run, so a failure
reproduces and a pass is not luck. ``HYPOTHESIS_PROFILE=explore`` draws new ones (to hunt for
bugs, not for CI).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def _one_tls_context_for_all_clients() -> None:
    """Every HTTP client a test makes (``httpx.post``, ``httpx.Client``, and the OpenAI and
    Anthropic clients, on httpx2) builds an SSL context with the CA bundle loaded: ~50 ms each,
    and the suite makes well over a thousand. The tests speak plain HTTP to loopback, so the
    default context (``verify=True``) is built once and shared, as httpx allows (``verify=ctx``);
    any other ``verify`` or a client certificate gets its own as before."""
    import importlib

    for name in ("httpx._transports.default", "httpx2._transports.default"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        build, shared = module.create_ssl_context, {}

        def create_ssl_context(verify=True, cert=None, trust_env=True, _build=build,
                               _shared=shared):
            if verify is not True or cert is not None:
                return _build(verify=verify, cert=cert, trust_env=trust_env)
            if trust_env not in _shared:
                _shared[trust_env] = _build(verify=True, cert=None, trust_env=trust_env)
            return _shared[trust_env]

        module.create_ssl_context = create_ssl_context


_one_tls_context_for_all_clients()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from harness.server_utils import tiny_dir

    return tiny_dir(tmp_path_factory, seed=0)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    from mlx_kvserver.models.loading import resolve_and_load

    return resolve_and_load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_lm_b(tmp_path_factory):
    """A second, different tiny model (for several models in one server)."""
    from mlx_kvserver.models.loading import resolve_and_load
    from harness.server_utils import tiny_dir

    return resolve_and_load(str(tiny_dir(tmp_path_factory, seed=1)))
