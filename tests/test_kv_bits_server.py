"""``--kv-bits`` through the real server: flags, cache on == cache off under the setting, a
restart answers from disk as the warm server did (with ``--kv-calibration on`` its keys
calibrated again to the same shape; 4-bit keys per channel over a page, the default, and per
position), another setting (calibration off or the other key scales included) is a miss that
keeps the first setting's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_kvserver import cli
from mlx_kvserver.config import ServerConfig
from tests.server_utils import running_server
from tests.test_persistence import TURNS, ask, page_files, run_turns
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def lm32(tmp_path_factory):
    """A tiny model with head_dim 32 (the smallest group MLX quantizes)."""
    from mlx_kvserver.models.loading import resolve_and_load

    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny32"), seed=2, hidden=128, heads=4)
    return resolve_and_load(str(path))


def config(cache_dir, bits, **kw) -> ServerConfig:
    return ServerConfig(max_tokens=10, page_size=8, kv_cache_dir=Path(cache_dir), kv_bits=bits,
                        kv_group_size=32, **kw)


def test_flags():
    default = cli.config_from_args(cli.build_parser().parse_args([]))
    assert default.kv_bits is None and default.kv_group_size == 64
    c = cli.config_from_args(cli.build_parser().parse_args(["--kv-bits", "4",
                                                            "--kv-group-size", "32"]))
    assert (c.kv_bits, c.kv_group_size, c.kv_rotate) == (4, 32, True)
    c = cli.config_from_args(cli.build_parser().parse_args(["--kv-bits", "8,4",
                                                            "--kv-rotation", "none"]))
    assert (c.kv_bits, c.kv_rotate) == ((8, 4), False)
    assert cli.config_from_args(cli.build_parser().parse_args(["--kv-bits", "8,8"])).kv_bits == 8
    assert default.kv_calibrate is False
    c = cli.config_from_args(cli.build_parser().parse_args(["--kv-bits", "4",
                                                            "--kv-calibration", "on"]))
    assert c.kv_calibrate is True
    assert default.kv_key_scales == "auto"
    c = cli.config_from_args(cli.build_parser().parse_args(["--kv-bits", "4",
                                                            "--kv-key-scales", "position"]))
    assert c.kv_key_scales == "position"
    with pytest.raises(SystemExit, match="kv-key-scales page"):
        cli.config_from_args(cli.build_parser().parse_args(
            ["--kv-bits", "4", "--kv-calibration", "on", "--kv-key-scales", "page"]))
    for bad in ("3", "8,3", "8,4,4", "eight"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--kv-bits", bad])


@pytest.mark.parametrize("bits,calibrate,scales", [(8, False, "auto"), (4, False, "auto"),
                                                   (4, False, "position"), (4, True, "auto")],
                         ids=["8", "4-channel", "4-position", "4-shaped"])
def test_restart_in_bits_answers_as_the_warm_server_and_as_without_cache(lm32, tmp_path, bits,
                                                                        calibrate, scales):
    kw = {"kv_calibrate": calibrate, "kv_key_scales": scales}
    with running_server([lm32], config(tmp_path, bits, **kw)) as url:
        history = run_turns(url, lm32.name, "q", TURNS[:3])
        history.append({"role": "user", "content": TURNS[3], "message_id": "q-u3"})
        warm, _, warm_usage = ask(url, lm32.name, history)
        cold, _, _ = ask(url, lm32.name, history, use_cache=False)
    assert warm == cold and warm_usage.prompt_tokens_details.cached_tokens > 0
    files = page_files(tmp_path)
    with running_server([lm32], config(tmp_path, bits, **kw)) as url:  # restart
        restored, _, usage = ask(url, lm32.name, history)
    assert restored == warm and usage.prompt_tokens_details.cached_tokens > 0
    other = {8: config(tmp_path, 4), 4: config(tmp_path, 4, kv_key_scales="page" if scales ==
                                                "position" else "position")}[bits]
    with running_server([lm32], other) as url:  # another setting: a miss
        _, _, usage = ask(url, lm32.name, history)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert set(files) <= set(page_files(tmp_path))  # the first setting's pages stay


def test_keys_calibrated_or_not_are_two_settings(lm32, tmp_path, caplog):
    history = [{"role": "user", "content": TURNS[0], "message_id": "c-u0"}]
    with caplog.at_level("INFO", logger="mlx_kvserver.engine"):
        with running_server([lm32], config(tmp_path, 4, kv_calibrate=True)) as url:
            shaped, _, _ = ask(url, lm32.name, history)
    assert any("keys calibrated" in r.getMessage() for r in caplog.records)
    assert any("keys scaled per position" in r.getMessage() for r in caplog.records)
    files = page_files(tmp_path)
    caplog.clear()
    with caplog.at_level("INFO", logger="mlx_kvserver.engine"), \
            running_server([lm32], config(tmp_path, 4, kv_calibrate=False)) as url:
        _, _, usage = ask(url, lm32.name, history + [{"role": "assistant", "content": shaped},
                                                     {"role": "user", "content": TURNS[1]}])
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert set(files) <= set(page_files(tmp_path))
    assert any("keys scaled per channel over pages of 8" in r.getMessage()
               for r in caplog.records)
