"""``--kv-bits`` through the real server: the flag (and the knobs it replaced, gone), cache on ==
cache off under the setting, a restart answers from disk as the warm server did (4-bit keys per
channel over a page, what ``--kv-bits`` picks for a model without recurrent state, and per
position, what it picks for one with it), another setting is a miss that keeps the first
setting's files."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.utils import _get_classes

from mlx_kvserver import flags
from mlx_kvserver.config import ServerConfig
from harness.server_utils import running_server
from tests.test_persistence import TURNS, ask, page_files, run_turns
from harness.tiny_families import _scale, tiny_family_config
from harness.tiny_model import make_tiny_model_dir, write_model_dir


@pytest.fixture(scope="module")
def lm32(tmp_path_factory):
    """A tiny model with head_dim 32 (one group of 32: 64 does not divide it)."""
    from mlx_kvserver.models.loading import resolve_and_load

    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny32"), seed=2, hidden=128, heads=4)
    return resolve_and_load(str(path))


@pytest.fixture(scope="module")
def state32(tmp_path_factory):
    """A tiny model with recurrent state (qwen3_5: gated delta and full attention layers), its
    attention's head_dim 32."""
    from mlx_kvserver.models.loading import resolve_and_load

    config = {**tiny_family_config("qwen3_5"), "head_dim": 32}
    model_class, args_class = _get_classes(config)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map_with_path(lambda p, w: w * _scale("qwen3_5", p, w.ndim),
                                    model.parameters()))
    model.set_dtype(mx.float32)
    path = write_model_dir(tmp_path_factory.mktemp("state32"), model, config)
    return resolve_and_load(str(path))


def config(cache_dir, bits) -> ServerConfig:
    return ServerConfig(max_tokens=10, page_size=8, kv_cache_dir=Path(cache_dir), kv_bits=bits)


def test_flags():
    default = flags.config_from_args(flags.build_parser().parse_args([]))
    assert default.kv_bits is None
    c = flags.config_from_args(flags.build_parser().parse_args(["--kv-bits", "8,4"]))
    assert c.kv_bits == (8, 4)
    assert flags.config_from_args(
        flags.build_parser().parse_args(["--kv-bits", "8,8"])).kv_bits == 8
    for bad in ("3", "8,3", "8,4,4", "eight"):
        with pytest.raises(SystemExit):
            flags.build_parser().parse_args(["--kv-bits", bad])
    # what --kv-bits now picks itself is no flag any more
    for gone in (["--kv-group-size", "32"], ["--kv-rotation", "none"],
                 ["--kv-calibration", "on"], ["--kv-key-scales", "position"],
                 ["--kv-attention", "packed"]):
        with pytest.raises(SystemExit):
            flags.build_parser().parse_args(["--kv-bits", "4", *gone])


@pytest.mark.parametrize("bits,model,keys", [(8, "lm32", "per channel over pages of 8"),
                                             (4, "lm32", "per channel over pages of 8"),
                                             (4, "state32", "per position")],
                         ids=["8", "4-channel", "4-position"])
def test_restart_in_bits_answers_as_the_warm_server_and_as_without_cache(request, tmp_path,
                                                                        caplog, bits, model,
                                                                        keys):
    lm = request.getfixturevalue(model)
    with caplog.at_level("INFO", logger="kv_cache"), \
            running_server([lm], config(tmp_path, bits)) as url:
        history = run_turns(url, lm.name, "q", TURNS[:3])
        history.append({"role": "user", "content": TURNS[3], "message_id": "q-u3"})
        warm, _, warm_usage = ask(url, lm.name, history)
        cold, _, _ = ask(url, lm.name, history, use_cache=False)
    assert any(f"keys scaled {keys}" in r.getMessage() for r in caplog.records)
    assert warm == cold and warm_usage.prompt_tokens_details.cached_tokens > 0
    files = page_files(tmp_path)
    with running_server([lm], config(tmp_path, bits)) as url:  # restart
        restored, _, usage = ask(url, lm.name, history)
    assert restored == warm and usage.prompt_tokens_details.cached_tokens > 0
    with running_server([lm], config(tmp_path, 4 if bits == 8 else 8)) as url:  # a miss
        _, _, usage = ask(url, lm.name, history)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert set(files) <= set(page_files(tmp_path))  # the first setting's pages stay
