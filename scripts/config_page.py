"""docs/CONFIGURATION.md, made from the server's argument parser (``mlx_kvserver/flags.py``).

    .venv/bin/python scripts/config_page.py          # writes the page
    .venv/bin/python scripts/config_page.py --check  # exit 1 when the page is not the parser's

Every flag with its default, what a settings file gives for it and its help (the text
``--help`` prints), by the parser's topics; the settings file; the environment variables.
tests/test_config_page.py fails when the page and ``--help`` differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_kvserver.flags import build_parser
from mlx_kvserver.config import NOT_IN_FILES, file_kind

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "CONFIGURATION.md"

EXAMPLE = """\
# qwen.toml: mlx-kvserver --config qwen.toml
model = "mlx-community/Qwen3-4B-4bit"
model-alias = ["*=default"]
port = 8081
max-batch = 8
kv-bits = "8,4"
memory-limit = 12
no-disk-cache = false
"""

# (name, what it does): the variables a user sets. The server's own are listed in full
# (tests/test_config_page.py reads the code for them); the libraries' are the ones that matter.
ENVIRONMENT = [
    ("MLX_KVSERVER_API_KEY", "the default of `--api-key`"),
    ("MAX_KV_SIZE_GB", "the default of `--max-kv-size-gb`"),
    ("MAX_KV_RAM_GB", "the default of `--max-kv-ram-gb`"),
    ("KV_STORE_URL", "the default of `--kv-store`"),
    ("KV_STORE_PASSWORD", "the shared store's password where its URL has none"),
    ("XDG_CACHE_HOME", "where the KV cache (`$XDG_CACHE_HOME/mlx-kvserver/kv`, else "
                       "`~/.cache/mlx-kvserver/kv`), the BLAS verdicts and the REPL's history "
                       "are kept"),
    ("MLX_KVSERVER_NO_BLAS", "`1`: preload no fast BLAS for MLX's CPU backend on Linux (as "
                             "`--no-fast-blas`)"),
    ("MLX_KVSERVER_BLAS_LIBRARY", "a BLAS library of yours (`/path/to/libblas.so`), tried "
                                  "first; proven in a child process like the others"),
    ("MLX_KVSERVER_BLAS_THREADS", "BLAS threads (default: one per physical core less one, at "
                                  "most 16); `OPENBLAS_NUM_THREADS` or `MKL_NUM_THREADS` too"),
    ("MLX_KVSERVER_BLAS_APPLIED", "set by the server itself when it re-executes with a BLAS "
                                  "preloaded (not for users)"),
    ("MLX_ENABLE_TF32", "MLX's: the server sets `0` unless it is set (on CUDA, TF32 matmuls "
                        "break exact reuse of the cache); `1` allows them"),
    ("HF_HUB_OFFLINE", "the Hugging Face hub's: `1` loads models from the local cache only"),
    ("HF_HOME", "the Hugging Face hub's: where downloaded models are kept "
                "(`~/.cache/huggingface`)"),
    ("HF_TOKEN", "the Hugging Face hub's: a token for gated or private models"),
    ("MLX_KVCHAT_HISTORY", "`mlx-kvchat`: its history file (the default of its `--history`)"),
    ("NO_COLOR", "`mlx-kvchat`: no colours"),
]


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell, read literally."""
    for c in "\\`*_<|":
        text = text.replace(c, "\\" + c)
    return text


def _flag(action: argparse.Action) -> str:
    """The flag as ``--help`` names it (``--kv-bits K[,V]``), in a table's code span."""
    name = action.option_strings[-1]
    if action.nargs != 0:
        name += " " + (action.metavar if action.metavar is not None else
                       "|".join(map(str, action.choices)) if action.choices is not None else
                       action.dest.upper())
    return "`" + name.replace("|", "\\|") + "`"


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0:
        return "on" if d else "off"
    if d is None or d == []:
        return "–"
    return f"`{d:g}`" if isinstance(d, float) else f"`{d}`"


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The page for ``parser`` (the server's, without the environment's defaults)."""
    parser = parser if parser is not None else build_parser({})
    helps = parser._get_formatter()
    out = [
        "# Configuration",
        "",
        "> Generated from the server's argument parser (`mlx_kvserver/flags.py`) by "
        "`scripts/config_page.py`; do not edit it here: change a flag there and run "
        "`.venv/bin/python scripts/config_page.py`. `tests/test_config_page.py` fails when this "
        "page and `mlx-kvserver --help` differ.",
        "",
        "`mlx-kvserver` (or `python -m mlx_kvserver`) takes each setting from the first of: the "
        "command line, the settings file named by `--config FILE`, an environment variable "
        "where the flag names one, the default below.",
        "",
        "## A settings file",
        "",
        "`--config FILE` reads a [TOML](https://toml.io) file of the same settings: each key is a "
        "flag's name without `--`, spelt as the flag is (`max-batch`, not `max_batch`), at the "
        "top level of the file. The column *file* below says what each takes: a repeatable flag a "
        "list (one value is a list of one), a switch `true` or `false`. A key that is no flag, a "
        "value of the wrong type or one the flag refuses stops the start with a message that "
        "names the key. A flag given on the command line wins over the file (a repeatable one "
        "replaces the file's list). Paths are read as on the command line: relative to the "
        "directory the server starts in, and `~` is not expanded.",
        "",
        "```toml",
        EXAMPLE.rstrip(),
        "```",
        "",
        "One file is one server's settings. A server serves its models (every `model`, and those "
        "`allow-models` lets load on demand) with one memory budget, one batch and one page "
        "setting; for models that want settings of their own, run one server per file, each on "
        "its own `port` and with its own `memory-limit` so that together they fit, and route to "
        "them by model name (llama-swap, or your client). Tables such as `[models.NAME]` are "
        "refused.",
        "",
        "## Flags",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
        if not actions:
            continue
        out += ["", f"### {group.title[0].upper()}{group.title[1:]}", ""]
        if group.description:
            out += [f"{group.description[0].upper()}{group.description[1:]}.", ""]
        out += ["| flag | default | file | |", "|---|---|---|---|"]
        for a in actions:
            kind = "–" if a.dest in NOT_IN_FILES else file_kind(a)
            out.append(f"| {_flag(a)} | {_default(a)} | {kind} | "
                       f"{_cell(helps._expand_help(a))} |")
    out += ["", "## Environment variables", "", "| variable | |", "|---|---|"]
    out += [f"| `{name}` | {what} |" for name, what in ENVIRONMENT]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write docs/CONFIGURATION.md from the parser.")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the page is not what the parser makes")
    args = p.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run scripts/config_page.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
