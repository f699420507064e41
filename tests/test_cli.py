"""The command line and the settings file it names (``mlx_kvserver.cli``): a file's values
reach ``ServerConfig`` as the same flags would, the command line wins over the file, and the file
over the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_kvserver.flags import config_from_args, parse_args


def settings(tmp_path: Path, text: str) -> str:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return str(path)


def test_a_settings_file_reaches_the_server_config(tmp_path):
    f = settings(tmp_path, """
model = ["/models/a", "/models/b"]
model-alias = "*=default"
port = 8081
temp = 0.5
max-batch = 8
kv-bits = "8,4"
page-size = 16
memory-limit = 12
no-disk-cache = true
eviction-policy = "s3fifo"
kv-cache-dir = "kv"
max-images = 4
allow-image-urls = true
""")
    c = config_from_args(parse_args(["--config", f], environ={}))
    assert c.models == ["/models/a", "/models/b"] and c.model_aliases == [("*", "default")]
    assert (c.port, c.temperature, c.max_batch, c.kv_bits) == (8081, 0.5, 8, (8, 4))
    assert c.page_size == 16 and c.memory_limit_gb == 12.0
    assert c.kv_cache_dir is None and c.eviction_policy == "s3fifo"
    assert c.max_images == 4 and c.allow_image_urls
    # the same settings as flags give the same config
    flags = ["--model", "/models/a", "--model", "/models/b", "--model-alias", "*=default",
             "--port", "8081", "--temp", "0.5", "--max-batch", "8", "--kv-bits", "8,4",
             "--page-size", "16", "--memory-limit", "12", "--no-disk-cache",
             "--eviction-policy", "s3fifo", "--kv-cache-dir", "kv", "--max-images", "4",
             "--allow-image-urls"]
    assert config_from_args(parse_args(flags, environ={})) == c


def test_the_command_line_wins_over_the_file(tmp_path):
    f = settings(tmp_path, 'model = ["a/b", "c/d"]\nmax-batch = 8\nport = 9000\n'
                           'no-disk-cache = true\nkv-cache-dir = "kv"\n')
    c = config_from_args(parse_args(["--max-batch", "4", "--config", f, "--model", "e/f",
                                     "--port", "8080"], environ={}))
    assert c.max_batch == 4 and c.models == ["e/f"]  # a repeatable flag replaces the list
    assert c.port == 8080  # given as the default's value: still the command line's
    assert c.kv_cache_dir is None  # what the command line does not say: the file's
    c = config_from_args(parse_args(["--config", f, "--kv-cache-dir", "other"], environ={}))
    assert c.kv_cache_dir is None and c.max_batch == 8 and c.port == 9000


def test_the_file_wins_over_the_environment(tmp_path):
    env = {"MAX_KV_RAM_GB": "3", "MLX_KVSERVER_API_KEY": "from-env"}
    f = settings(tmp_path, "max-kv-ram-gb = 5\n")
    c = config_from_args(parse_args(["--config", f], environ=env))
    assert c.max_kv_ram_gb == 5.0 and c.api_key == "from-env"
    assert config_from_args(parse_args([], environ=env)).max_kv_ram_gb == 3.0


def test_a_files_values_meet_the_flags_checks(tmp_path):
    f = settings(tmp_path, "max-batch = 0\n")
    with pytest.raises(SystemExit, match="--max-batch and --prefill-chunk must be 1 or more"):
        config_from_args(parse_args(["--config", f], environ={}))
    f = settings(tmp_path, 'model-alias = "no-equals-sign"\n')
    with pytest.raises(SystemExit, match="--model-alias 'no-equals-sign': want NAME=SERVED"):
        config_from_args(parse_args(["--config", f], environ={}))


def test_no_file_no_change():
    assert vars(parse_args(["--max-batch", "3"], environ={}))["max_batch"] == 3
    assert parse_args([], environ={}).config is None


def test_kv_bits_for_a_model_whose_head_dim_takes_no_group_stops_the_start_saying_so(tmp_path):
    """Groups of 64, or 32 where 64 does not divide head_dim: a head_dim of 16 takes neither,
    and the start stops with the reason (not a draft model's)."""
    from mlx_kvserver.server import load_engine
    from harness.tiny_model import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "m", hidden=64, heads=4)  # head_dim 16
    config = config_from_args(parse_args(["--model", str(path), "--kv-bits", "4",
                                          "--no-disk-cache"], environ={}))
    with pytest.raises(SystemExit, match=r"^--kv-bits needs a head_dim that is a multiple of "
                                         r"32, not 16$"):
        load_engine(config)
