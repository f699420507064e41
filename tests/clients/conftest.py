"""The clients' shared server with a model that takes images."""

from __future__ import annotations

import pytest

from harness.server_utils import running_server
from mlx_kvserver.config import ServerConfig


@pytest.fixture(scope="module")
def vision_served(tiny_lm, tmp_path_factory):
    """A server with the tiny Qwen2.5-VL (first: the default model) and a text model; yields
    its base URL and the vision model."""
    import huggingface_hub

    from harness.tiny_vlm import make_tiny_vlm_dir
    from mlx_kvserver.models.loading import resolve_and_load

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        folder = make_tiny_vlm_dir(tmp_path_factory.mktemp("vlm") / "tiny-vlm", seed=0)
        vlm = resolve_and_load(str(folder))
        config = ServerConfig(max_tokens=8, kv_cache_dir=tmp_path_factory.mktemp("vlm-kv"))
        with running_server([vlm, tiny_lm], config) as url:
            yield url, vlm
