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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.server_utils import tiny_dir

    return tiny_dir(tmp_path_factory, seed=0)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    from mlx_kvserver.models import resolve_and_load

    return resolve_and_load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_lm_b(tmp_path_factory):
    """A second, different tiny model (for several models in one server)."""
    from mlx_kvserver.models import resolve_and_load
    from tests.server_utils import tiny_dir

    return resolve_and_load(str(tiny_dir(tmp_path_factory, seed=1)))
