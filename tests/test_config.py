"""Server settings (``mlx_kvserver.config``): a settings file checked against the flags, each
fault a message that names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_kvserver.flags import build_parser
from mlx_kvserver.config import file_kind, file_options, read_settings


def read(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return read_settings(path, build_parser({}))


def test_values_come_back_as_the_flags_give_them(tmp_path):
    got = read(tmp_path, 'model = "a/b"\nkv-bits = 8\nkv-cache-dir = "kv"\nmax-kv-size-gb = 3\n'
                         'allow-download = true\nno-disk-cache = false\npage-size = 16\n')
    assert got == {"models": ["a/b"], "kv_bits": 8, "kv_cache_dir": Path("kv"),
                   "max_kv_size_gb": 3.0, "allow_download": True, "no_disk_cache": False,
                   "page_size": 16}
    assert isinstance(got["max_kv_size_gb"], float)


@pytest.mark.parametrize("text, message", [
    ("max_batch = 8", r"'max_batch' is no setting \(did you mean 'max-batch'\?\)"),
    ("batch = 8", r"'batch' is no setting"),
    ('config = "other.toml"', r"'config' is no setting"),
    ("[models.qwen]\nmax-batch = 8", r"\[models\] is a table: .* one file for one server"),
    ('max-batch = "eight"', r"max-batch = 'eight': want an integer for --max-batch"),
    ("max-batch = 8.5", r"max-batch = 8.5: want an integer for --max-batch"),
    ("max-batch = true", r"max-batch = True: want an integer for --max-batch"),
    ('temp = "0.5"', r"temp = '0.5': want a number for --temp"),
    ('no-disk-cache = "yes"', r"no-disk-cache = 'yes': want true or false for --no-disk-cache"),
    ("model = 3", r"model = 3: want a string for --model"),
    ('model = ["a/b", 3]', r"model = 3: want a string for --model"),
    ("host = [\"a\"]", r"host = \['a'\]: want a string for --host"),
    ("kv-bits = 5", r"kv-bits = 5: .*--kv-bits"),
    ('kv-bits = [8]', r"kv-bits = \[8\]: want an integer or a string for --kv-bits"),
    ('eviction-policy = "random"', r"eviction-policy = 'random': want one of 'lru', 'fifo'"),
    ('kv-rotation = "none"', r"'kv-rotation' is no setting"),  # gone: --kv-bits picks it
    ("max-batch = ", r"not TOML"),
])
def test_a_bad_setting_stops_with_its_key(tmp_path, text, message):
    with pytest.raises(SystemExit, match=message) as e:
        read(tmp_path, text + "\n")
    assert str(tmp_path / "server.toml") in str(e.value)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--config .*nothing.toml: No such file"):
        read_settings(tmp_path / "nothing.toml", build_parser({}))


def test_every_flag_has_a_key_and_a_kind():
    options = file_options(build_parser({}))
    assert "help" not in options and "config" not in options and len(options) > 30
    kinds = {key: file_kind(a) for key, a in options.items()}
    assert kinds["max-batch"] == "integer" and kinds["temp"] == "number"
    assert kinds["host"] == "string" and kinds["kv-cache-dir"] == "string"
    assert kinds["no-disk-cache"] == "true or false"
    assert kinds["kv-bits"] == "integer or string"
    assert kinds["model"] == "list of strings (or one string)"
