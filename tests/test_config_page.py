"""docs/CONFIGURATION.md against the argument parser (``scripts/config_page.py``): the page is
what the parser makes, so a flag or a help changed without making the page again fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mlx_kvserver.flags import build_parser, config_from_args, parse_args
from scripts import config_page
from scripts.config_page import EXAMPLE, PAGE, render

ROOT = Path(__file__).resolve().parent.parent


def test_the_page_is_what_the_parser_makes():
    assert PAGE.read_text() == render(), \
        "docs/CONFIGURATION.md differs from --help: run .venv/bin/python scripts/config_page.py"


def test_a_help_changed_without_the_page_fails():
    parser = build_parser({})
    action = next(a for a in parser._actions if "--max-batch" in a.option_strings)
    action.help = "answers decoded together, a changed help"
    page = render(parser)
    assert page != PAGE.read_text() and "answers decoded together, a changed help" in page
    assert "a changed help" in " ".join(parser.format_help().split())  # what --help says


def test_every_flag_of_help_is_on_the_page():
    help_text = build_parser({}).format_help()
    flags = set(re.findall(r"(--[a-z][a-z-]+)", help_text)) - {"--help"}
    assert len(flags) > 30
    page = PAGE.read_text()
    assert [f for f in sorted(flags) if f"| `{f}" not in page] == []


def test_the_page_names_every_environment_variable_of_the_server():
    """Every name of the server's own variables in the code (the prefixes below) is on the
    page, with the libraries' that the page lists."""
    names = set()
    for path in [*ROOT.joinpath("mlx_kvserver").rglob("*.py"), *ROOT.joinpath("kv_cache").rglob(
            "*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"(MLX_KVSERVER|MLX_KVCHAT|KV_STORE|MAX_KV|MLX)_[A-Z0-9_]+", node.value):
                names.add(node.value)
    assert {"MLX_KVSERVER_API_KEY", "KV_STORE_PASSWORD", "MLX_KVSERVER_NO_BLAS"} <= names
    listed = {name for name, _ in config_page.ENVIRONMENT}
    assert names - listed == set()
    page = PAGE.read_text()
    assert [n for n in sorted(listed) if f"| `{n}` |" not in page] == []


def test_the_pages_example_file_reads(tmp_path):
    f = tmp_path / "qwen.toml"
    f.write_text(EXAMPLE)
    c = config_from_args(parse_args(["--config", str(f)], environ={}))
    assert c.models == ["mlx-community/Qwen3-4B-4bit"] and c.port == 8081
    assert c.kv_bits == (8, 4) and c.memory_limit_gb == 12.0 and c.max_batch == 8
    assert "```toml\n" + EXAMPLE in PAGE.read_text()


def test_check_says_when_the_page_is_stale(tmp_path, monkeypatch):
    assert config_page.main(["--check"]) == 0
    stale = tmp_path / "CONFIGURATION.md"
    stale.write_text(PAGE.read_text().replace("answers decoded together", "answers together"))
    monkeypatch.setattr(config_page, "PAGE", stale)
    monkeypatch.setattr(config_page, "ROOT", tmp_path)
    assert config_page.main(["--check"]) == 1
    assert config_page.main([]) == 0 and stale.read_text() == render()
