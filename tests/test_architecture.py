"""The layers' import rules, read from the source (docs/ARCHITECTURE.md, "Layers").

``kv_cache`` never imports the server; the server uses the library through its package root
only (``from kv_cache import ...``); inside the library nothing imports a layer above its own:
pages know the cache's description (``model/spec.py``, ``model/kinds.py``) and nothing else of
the model side; the model side knows pages; the tiers know pages and the description; the
manager and its parts at the top know everything. Imports under ``if TYPE_CHECKING:`` are
annotations, not dependencies, and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTION = {"kv_cache.model.spec", "kv_cache.model.kinds"}
BASE = {"kv_cache.errors", "kv_cache.tokens"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` outside ``if TYPE_CHECKING:`` blocks, with
    ``from pkg import mod`` counted as ``pkg.mod`` where ``pkg.mod`` is a module here."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                as_module = (ROOT / (sub.replace(".", "/") + ".py")).exists() or \
                    (ROOT / sub.replace(".", "/")).is_dir()
                out.append((node.lineno, sub if as_module else node.module))
    return out


def _layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in DESCRIPTION:
        return "description"
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in ("pages", "model", "tiers"):
        return parts[1]
    return "top"


ALLOWED = {  # layer -> the layers it may import
    "base": {"base"},
    "description": {"base", "description", "pages"},  # kinds/spec name a page codec (pages/quant.py)
    "pages": {"base", "description", "pages"},
    "model": {"base", "description", "pages", "model"},
    "tiers": {"base", "description", "pages", "tiers"},
    "top": {"base", "description", "pages", "model", "tiers", "top"},
}


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _files("kv_cache"), ids=lambda p: str(p.relative_to(ROOT)))
def test_kv_cache_imports_only_its_own_layer_and_below(path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    here = _layer(module)
    bad = [(line, m) for line, m in _imports(path)
           if m.startswith("mlx_kvserver")
           or (m.startswith("kv_cache.") and _layer(m) not in ALLOWED[here]
               and not module.startswith(m + "."))]  # a package's own __init__ is no layer
    assert not bad, f"{module} ({here}) imports above its layer: {bad}"


@pytest.mark.parametrize("path", _files("mlx_kvserver"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_uses_the_library_through_its_package_root(path):
    bad = [(line, m) for line, m in _imports(path)
           if m.startswith("kv_cache.") and m.split(".")[1] not in _root_names()]
    assert not bad, f"{path.relative_to(ROOT)} reaches inside kv_cache: {bad}"


def _root_names() -> set[str]:
    import kv_cache

    return set(kv_cache.__all__)


def test_the_rules_see_a_violation(tmp_path):
    """The checks above read real imports (not an empty list that passes anything)."""
    src = tmp_path / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mlx_kvserver\n"
                   "from kv_cache.manager import CacheManager\nimport mlx_kvserver.engine\n")
    assert _imports(src) == [(1, "typing"), (4, "kv_cache.manager"), (5, "mlx_kvserver.engine")]
    assert _layer("kv_cache.manager") == "top" and "top" not in ALLOWED["pages"]
