"""Every file or folder of this repository that the prose names exists.

The prose is the docstrings and comments of every Python file, ``pyproject.toml``, ``README.md``
and ``docs/*.md``. A name counts as a path of ours when it has a slash and ends in a file
extension (``kv_cache/manager.py``, ``docs/CACHE.md``) or in a slash (``tests/engine/``), and
starts either at one of the repository's top folders, or at a folder inside ``mlx_kvserver/`` or
``kv_cache/``, as the prose shortens them (``chat/render.py``, ``tiers/store/``): then it must
exist below one of those packages' folders. A pattern (``benchmarks/results/ttft/<stamp>.json``)
names a file a run writes: its folders must exist, all but the one that holds the placeholder
(the first run may make that one). Markdown links are resolved against the file that holds them.
Names of other projects' files say whose they are (``mlx_lm/models/llama.py``) and are not
checked.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlx_kvserver", "kv_cache")
TOKEN = re.compile(r"[\w.<>*{}/-]+")
EXTENSION = re.compile(r"\.[a-z][a-z0-9]*$")  # not ``api/validate.RANGES``
PLACEHOLDER = re.compile(r"[<>*{}]")
LINK = re.compile(r"\]\(([^)\s]+)\)")
NOT_OURS = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|/)")  # a URL, an anchor, an absolute path


@functools.cache
def _ignored(top: str) -> bool:
    """Whether git ignores the top folder ``top`` (build outputs, a test's installed tools)."""
    return subprocess.run(["git", "check-ignore", "-q", top], cwd=ROOT).returncode == 0


def _ours(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return not (any(p.startswith(".") or p.endswith(".egg-info") or p == "__pycache__"
                    for p in parts) or _ignored(parts[0]))


@functools.cache
def _top_folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and _ours(p)} | {".ci"}


@functools.cache
def _package_folders(root: Path) -> tuple[Path, ...]:
    """Every folder of the packages (the packages' roots first): a shortened path starts at a
    folder inside one of them."""
    roots = [root / p for p in PACKAGES]
    return (*roots, *(p for r in roots for p in sorted(r.rglob("*")) if p.is_dir() and _ours(p)))


def _python_prose(path: Path) -> str:
    """The comments and docstrings of the Python file ``path``."""
    source = path.read_text()
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    docs = [ast.get_docstring(n, clean=False) or "" for n in ast.walk(ast.parse(source, str(path)))
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n".join(comments + docs)


def _prose_files() -> list[Path]:
    python = sorted(ROOT.glob("*.py")) + [p for top in sorted(_top_folders(ROOT))
                                         for p in sorted((ROOT / top).rglob("*.py")) if _ours(p)]
    markdown = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [*python, ROOT / "pyproject.toml", *markdown]


def _prose(path: Path) -> str:
    return _python_prose(path) if path.suffix == ".py" else path.read_text()


def named_paths(text: str) -> list[str]:
    """The paths of ours named in ``text`` (see the module's docstring), in order."""
    top, inner = _top_folders(ROOT), {p.name for p in _package_folders(ROOT)[len(PACKAGES):]}
    out = []
    for token in TOKEN.findall(text):
        token = token.rstrip(".-")
        parts = token.split("/")
        if len(parts) < 2 or not parts[0] or (parts[-1] and not EXTENSION.search(parts[-1])):
            continue
        if parts[0] in top or parts[0] in inner:
            out.append(token)
    return out


def exists(name: str) -> bool:
    """Whether the path ``name`` (from :func:`named_paths`) is here: from the root where it
    starts at a top folder, else below a folder of the packages; of a pattern, its folders but
    the one that holds its first placeholder."""
    parts = name.split("/")
    cut = next((i for i, p in enumerate(parts) if PLACEHOLDER.search(p)), None)
    if cut is not None:
        parts = parts[:max(cut - 1, 1)] + [""]
    path = "/".join(parts)
    bases = [ROOT] if parts[0] in _top_folders(ROOT) else _package_folders(ROOT)
    return any((base / path).exists() for base in bases)


def broken_links(path: Path, text: str) -> list[str]:
    """The Markdown links of ``text`` (the file ``path``) to a file or folder that is not here."""
    out = []
    for target in LINK.findall(text):
        if NOT_OURS.match(target):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            out.append(target)
    return out


def stale(path: Path) -> list[str]:
    text = _prose(path)
    names = [n for n in named_paths(text) if not exists(n)]
    links = broken_links(path, text) if path.suffix == ".md" else []
    return sorted(set(names + links))


@pytest.mark.parametrize("path", _prose_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_prose_names_exists(path):
    assert stale(path) == [], f"{path.relative_to(ROOT)} names paths that are not here"


def test_the_check_sees_a_stale_name(tmp_path, monkeypatch):
    """Names are read from comments and docstrings (not code), at a top folder or shortened,
    with patterns cut at their placeholder; Markdown links resolve against their file."""
    for folder in ("docs", "kv_cache/tiers/disk", "mlx_kvserver/engine", "benchmarks/results/ttft"):
        (tmp_path / folder).mkdir(parents=True)
    for name in ("kv_cache/tiers/disk/format.py", "mlx_kvserver/engine/budget.py", "docs/A.md"):
        (tmp_path / name).write_text("")
    module = tmp_path / "mlx_kvserver" / "x.py"
    module.write_text('"""Reads kv_cache/tiers/disk/format.py and kv_cache/disk_format.py."""\n'
                      'PATH = "kv_cache/gone.py"  # not prose\n'
                      "# engine/budget.py, engine/gone.py, mlx_lm/models/llama.py, MB/s\n"
                      "# benchmarks/results/new/<stamp>.json, benchmarks/gone/x/<stamp>.json.\n")
    doc = tmp_path / "docs" / "B.md"
    doc.write_text("[a](A.md#top) [b](docs/A.md) [c](https://x.org/y.md) `docs/C.md`\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert named_paths("see engine/budget.py, and tiers/disk/, not and/or") == [
        "engine/budget.py", "tiers/disk/"]
    assert stale(module) == ["benchmarks/gone/x/<stamp>.json", "engine/gone.py",
                             "kv_cache/disk_format.py"]
    assert stale(doc) == ["docs/A.md", "docs/C.md"]
