"""Shared fixtures: a tiny random-weight model folder and loaded models (no network)."""

from __future__ import annotations

import pytest


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
