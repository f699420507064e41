"""The layers' import rules, read from the source (docs/ARCHITECTURE.md, "Layers").

``kv_cache`` never imports the server; the server uses the library through its face only
(``from kv_cache import ...``: ``FACE``) and the runner's hooks (``kv_cache.hooks``: ``HOOKS``),
never reads the parts a manager holds, and its own rooms import only down (base < platform, chat <
storage, models < engine < api < cli.py, flags.py, server.py < clients: ``SERVER_ALLOWED``); the
API translates, so ``api/`` imports neither the library nor the modules of ``models/`` that load
models (``MODEL_LOADING``), and clients start a server through ``server.py``, never ``cli.py``;
inside the library nothing imports a layer above its own,
floor by floor: ``layout/`` (the cache's description: kinds of layer, a page's geometry and
codec) knows only the base; ``pages/`` knows the layout; ``model/`` knows pages; ``tiers/`` know
pages and the layout; the manager and its parts at the top know everything. Relative imports
count, and so does the package root (``from kv_cache import ...`` inside the library is an
import of the top). Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and
are not counted for the floors; no two modules import each other, though, not even through a
circle of several or for annotations alone (``test_no_module_imports_itself_round_a_circle``).
In both packages a class is composed of the objects it holds: none inherits a mixin from another
file (``test_no_class_is_mixed_in_from_another_file``).
Outside the packages, ``benchmarks/`` and ``scripts/`` share ``harness/`` with the tests (tiny
models, servers, agent sessions) and never import ``tests/``; the harness imports none of the three.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = {"kv_cache.errors", "kv_cache.tokens"}


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, module: str | None = None,
             typing: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` outside ``if TYPE_CHECKING:`` blocks (inside
    them too with ``typing``), with ``from pkg import mod`` counted as ``pkg.mod`` where
    ``pkg.mod`` is a module here, and relative imports resolved against ``module`` (the file's
    own module name)."""
    module = module if module is not None else _module_of(path)
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, path, module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                as_module = (ROOT / (sub.replace(".", "/") + ".py")).exists() or \
                    (ROOT / sub.replace(".", "/")).is_dir()
                out.append((node.lineno, sub if as_module else base))
    return out


def _from_module(node: ast.ImportFrom, path: Path, module: str) -> str:
    """The module ``node`` (in ``path``, of module ``module``) imports from, a relative one
    resolved."""
    base = node.module or ""
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return base


def _layer(module: str) -> str:
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in ("layout", "pages", "model", "tiers"):
        return parts[1]
    return "top"  # the package root (``import kv_cache``) is the top too: it names everything


ALLOWED = {  # layer -> the layers it may import
    "base": {"base"},
    "layout": {"base", "layout"},  # the cache's description: kinds, a page's geometry and codec
    "pages": {"base", "layout", "pages"},
    "model": {"base", "layout", "pages", "model"},
    "tiers": {"base", "layout", "pages", "tiers"},
    "top": {"base", "layout", "pages", "model", "tiers", "top"},
}


def _files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/: the rules would check nothing"
    return files


@pytest.mark.parametrize("path", _files("kv_cache"), ids=lambda p: str(p.relative_to(ROOT)))
def test_kv_cache_imports_only_its_own_layer_and_below(path):
    module = _module_of(path)
    here = _layer(module)
    bad = [(line, m) for line, m in _imports(path)
           if m.startswith("mlx_kvserver")
           or ((m == "kv_cache" or m.startswith("kv_cache.")) and _layer(m) not in ALLOWED[here]
               and not (m != "kv_cache" and module.startswith(m + ".")))]  # a package's own
    # __init__ (kv_cache.pages for kv_cache.pages.pool) is no layer; the root is the top
    assert not bad, f"{module} ({here}) imports above its layer: {bad}"


FACE = {  # what a user of the cache names: ``from kv_cache import ...``
    "open_cache", "CacheManager", "CacheSpec", "spec_of_model", "Match", "FormatError",
    "OutOfBlocksError", "TransferError", "export_entry", "export_key", "import_entry",
    "parse_kv_bits", "check_store_url", "Span",
    # a publisher of KV cache events for a router watches the tiers' pages (kv_cache.pages.events)
    "watch_pages", "CacheEvents", "StoredPage"}
HOOKS = {  # what a model runner names around a forward pass: ``from kv_cache.hooks import ...``
    "forward", "install", "batch_caches", "ragged_caches", "finish_batch", "OWN_KEYS_APART",
    "PagedSequence", "boundaries", "common_prefix", "Bidirectional"}
WAYS_IN = ("kv_cache", "kv_cache.hooks")


def _library_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every name ``path`` imports from the library, ``TYPE_CHECKING``
    imports included (``import kv_cache.x`` gives the name ``*``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "*") for a in node.names
                    if a.name.split(".")[0] == "kv_cache"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "kv_cache":
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return sorted(out)


def _past_the_face(path: Path) -> list[tuple[int, str, str]]:
    """The library imports of ``path`` that are not names of the face or of the hooks."""
    names = {"kv_cache": FACE | {"hooks"}, "kv_cache.hooks": HOOKS}
    return [(line, m, n) for line, m, n in _library_imports(path)
            if m not in WAYS_IN or n not in names[m]]


@pytest.mark.parametrize("path", _files("mlx_kvserver") + _files("scripts"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_uses_the_library_through_its_face_or_the_hooks(path):
    """The server and its tools name the library's face (``kv_cache``) and the runner's hooks
    (``kv_cache.hooks``) alone, never a module below them. (The library's own tests, and the
    benchmarks that measure its layers, reach below.)"""
    bad = _past_the_face(path)
    assert not bad, f"{path.relative_to(ROOT)} reaches inside kv_cache: {bad}"


def test_the_face_and_the_hooks_are_the_listed_names():
    import kv_cache
    import kv_cache.hooks

    assert set(kv_cache.__all__) == FACE and len(kv_cache.__all__) == len(FACE)
    assert set(kv_cache.hooks.__all__) == HOOKS and len(kv_cache.hooks.__all__) == len(HOOKS)
    assert all(hasattr(kv_cache, n) for n in FACE)
    assert all(hasattr(kv_cache.hooks, n) for n in HOOKS)


def test_the_face_rule_sees_a_violation(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from kv_cache import open_cache, hooks\nfrom kv_cache.hooks import forward\n"
                   "from kv_cache.pages.pool import PagePool\nfrom kv_cache import atomic_fs\n"
                   "import kv_cache.manager\nfrom kv_cache.hooks import CacheSpec\n")
    assert _past_the_face(src) == [(3, "kv_cache.pages.pool", "PagePool"),
                                   (4, "kv_cache", "atomic_fs"),
                                   (5, "kv_cache.manager", "*"),
                                   (6, "kv_cache.hooks", "CacheSpec")]


def _reads_of_parts(path: Path, parts: set[str]) -> list[tuple[int, str]]:
    """(line, source) of each read in ``path`` of a manager's part: an attribute in ``parts``
    of something named a manager (``manager``, ``self.manager``, ``self.managers[name]``), or a
    page pool of anything (``.pool``: the server has none of its own)."""
    def named_manager(e: ast.expr) -> bool:
        e = e.value if isinstance(e, ast.Subscript) else e
        name = e.id if isinstance(e, ast.Name) else e.attr if isinstance(e, ast.Attribute) else ""
        return name in ("manager", "managers")

    tree = ast.parse(path.read_text(), str(path))
    return sorted((n.lineno, ast.unparse(n)) for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute)
                  and (n.attr == "pool" or (n.attr in parts and named_manager(n.value))))


@pytest.mark.parametrize("path", _files("mlx_kvserver"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_reaches_no_part_of_a_manager(path):
    """The server asks the manager (its methods), never the parts it holds (its page pool,
    store, views, counters, entries, ...: what its constructor sets)."""
    parts = _set_attributes(_class_node(ROOT / "kv_cache" / "manager.py", "CacheManager"))
    assert {"pool", "store", "lookup", "entries", "residents", "saving", "room"} <= parts
    bad = _reads_of_parts(path, parts)
    assert not bad, f"{path.relative_to(ROOT)} reads a manager's parts: {bad}"


def test_the_parts_rule_sees_a_violation(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("a = manager.pool.spec\nb = self.manager.store.get(k)\nc = manager.start(p)\n"
                   "d = sum(m.pool.stats() for m in ms)\ne = self.managers[k].entries\n"
                   "f = self.store.put(k)\n")
    assert _reads_of_parts(src, {"pool", "store", "entries"}) == [
        (1, "manager.pool"), (2, "self.manager.store"), (4, "m.pool"),
        (5, "self.managers[k].entries")]


def _class_node(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text(), str(path))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _set_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's methods set on ``self`` (``self.x = ...``, augmented or not)."""
    out = set()
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else \
            [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) \
                        and e.value.id == "self":
                    out.add(e.attr)
    return out


def _defined(cls: ast.ClassDef) -> set[str]:
    """The names a class body defines: methods, properties, class attributes, slots."""
    out = set()
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def _read_attributes(cls: ast.ClassDef) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _classes(package: str) -> dict[str, dict[str, ast.ClassDef]]:
    """Module -> its top-level classes, for every module of ``package``."""
    out = {}
    for path in _files(package):
        tree = ast.parse(path.read_text(), str(path))
        out[_module_of(path)] = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return out


def _bound_names(path: Path, module: str) -> dict[str, tuple[str, str]]:
    """Name -> (module, name) for each ``from ... import`` of ``path`` (relative ones resolved)."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = _from_module(node, path, module)
            out.update({a.asname or a.name: (base, a.name) for a in node.names})
    return out


def _mixins_across_files(package: str) -> list[tuple[str, str, str]]:
    """(module, class, base) for each class of ``package`` built on a mixin of another module of
    it. A mixin: a class of the package with no ``__init__`` and no base outside the package
    (``object`` aside), whose methods read an attribute of ``self`` that neither it nor its bases
    set or define: it works only on a host that sets it."""
    classes = _classes(package)

    def resolve(module: str, node: ast.expr) -> tuple[str, str] | None:
        if isinstance(node, ast.Name):
            if node.id in classes.get(module, {}):
                return module, node.id
            target = _bound_names(ROOT / (module.replace(".", "/") + ".py"), module).get(node.id)
            if target is None:
                init = ROOT / module.replace(".", "/") / "__init__.py"
                target = _bound_names(init, module).get(node.id) if init.exists() else None
            return target if target is not None and target[1] in classes.get(target[0], {}) \
                else None
        return None

    def own(module: str, name: str, seen: tuple = ()) -> tuple[set[str], bool]:
        """What a class and its bases set or define; whether all its bases are the package's."""
        cls = classes[module][name]
        names, inside = _set_attributes(cls) | _defined(cls), True
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id == "object":
                continue
            where = resolve(module, b)
            if where is None or where in seen:
                inside = False
                continue
            more, ok = own(*where, seen + ((module, name),))
            names |= more
            inside = inside and ok
        return names, inside

    def is_mixin(module: str, name: str) -> bool:
        cls = classes[module][name]
        if "__init__" in _defined(cls):
            return False
        names, inside = own(module, name)
        return inside and bool(_read_attributes(cls) - names)

    found = []
    for module, by_name in sorted(classes.items()):
        if module.endswith(".__init__"):
            continue
        for name, cls in by_name.items():
            for b in cls.bases:
                where = resolve(module, b)
                if where is not None and where[0] != module and is_mixin(*where):
                    found.append((module, name, f"{where[0]}.{where[1]}"))
    return found


@pytest.mark.parametrize("package", ["kv_cache", "mlx_kvserver"])
def test_no_class_is_mixed_in_from_another_file(package):
    """A class is composed of the objects it holds, each given what it works on; none inherits
    a mixin from another file (methods that read attributes only their host sets)."""
    assert _mixins_across_files(package) == []


def test_the_cache_manager_and_the_page_pool_are_built_on_nothing():
    from kv_cache import CacheManager
    from kv_cache.pages.pool import PagePool

    assert CacheManager.__bases__ == (object,) and PagePool.__bases__ == (object,)


def test_the_mixin_rule_sees_a_mixin(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "part.py").write_text(
        "class Part:\n    def size(self):\n        return len(self.items)\n"
        "class Whole:\n    def __init__(self):\n        self.items = []\n"
        "class Plain:\n    K = 1\n    def k(self):\n        return self.K\n")
    (pkg / "host.py").write_text(
        "from pkg.part import Part, Plain, Whole\nfrom .part import Part as P\n"
        "class Host(Part):\n    def __init__(self):\n        self.items = [1]\n"
        "class Again(P):\n    pass\nclass Sub(Whole):\n    pass\nclass Fine(Plain):\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _mixins_across_files("pkg") == [("pkg.host", "Host", "pkg.part.Part"),
                                           ("pkg.host", "Again", "pkg.part.Part")]


MEMORY_POLICY = ("mlx_kvserver/engine/pressure.py", "mlx_kvserver/engine/memory.py")
STEPPING = {"mlx_kvserver.engine.scheduler", "mlx_kvserver.engine.step",
            "mlx_kvserver.engine.engine"}  # what decides a step, runs it, runs the thread


def _imports_of_stepping(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of each import in ``path`` of what decides or runs a step, annotations
    (``TYPE_CHECKING``) included."""
    return sorted((line, m) for line, m in _imports(path, module, typing=True) if m in STEPPING)


@pytest.mark.parametrize("path", MEMORY_POLICY)
def test_the_memory_policy_returns_decisions_and_never_calls_the_scheduler(path):
    """The memory policy (the budget's decisions in ``pressure.py``, the budget itself in
    ``memory.py``) answers from the facts it is given: it imports neither the scheduler nor
    what runs a step, not even for an annotation, and is built without one."""
    assert not _imports_of_stepping(ROOT / path), f"{path} imports the scheduler's side"


def test_the_pressure_is_built_on_the_budget_alone():
    import inspect

    from mlx_kvserver.engine.pressure import Pressure

    assert list(inspect.signature(Pressure).parameters) == ["memory", "name"]


def test_the_policy_rule_sees_a_violation(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from .scheduler import Scheduler\nfrom .memory import GB\n"
                   "from mlx_kvserver.engine import step\n")
    assert _imports_of_stepping(src, "mlx_kvserver.engine.x") == [
        (3, "mlx_kvserver.engine.scheduler"), (5, "mlx_kvserver.engine.step")]


SERVER_ALLOWED = {  # the server's rooms, floor by floor: each may import the ones listed
    "base": {"base"},  # config.py, errors.py
    "platform": {"base", "platform"},  # the CPU's BLAS, ELF symbols, memory facts
    "chat": {"base", "chat"},  # the conversation model, templates, output parsing, grammars
    "storage": {"base", "chat", "storage"},  # what the server keeps on disk: stored responses
    "models": {"base", "chat", "models"},  # loading, tokenizer, registry, served models
    "engine": {"base", "platform", "chat", "models", "engine"},  # thread, scheduler, runner
    "api": {"base", "platform", "chat", "storage", "models", "engine", "api"},  # HTTP: one
    # module per API
    "top": {"base", "platform", "chat", "storage", "models", "engine", "api", "top"},  # cli.py,
    # flags.py, server.py, __main__.py
    "clients": {"base", "platform", "chat", "storage", "models", "engine", "api", "top",
                "clients"},
}


def _server_layer(module: str) -> str:
    parts = module.split(".")
    if module in ("mlx_kvserver", "mlx_kvserver.config", "mlx_kvserver.errors"):
        return "base"
    if len(parts) > 1 and parts[1] in SERVER_ALLOWED and parts[1] not in ("base", "top"):
        return parts[1]
    return "top"


@pytest.mark.parametrize("path", _files("mlx_kvserver"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_imports_only_its_own_floor_and_below(path):
    module = _module_of(path)
    here = _server_layer(module)
    bad = [(line, m) for line, m in _imports(path) if m.startswith("mlx_kvserver.")
           and _server_layer(m) not in SERVER_ALLOWED[here]]
    assert not bad, f"{module} ({here}) imports above its floor: {bad}"


def test_every_server_module_has_a_room():
    """No module left at the root besides the entry points and the base (config, errors)."""
    loose = [_module_of(p) for p in _files("mlx_kvserver")
             if len(p.relative_to(ROOT / "mlx_kvserver").parts) == 1]
    assert sorted(loose) == ["mlx_kvserver", "mlx_kvserver.__main__", "mlx_kvserver.cli",
                             "mlx_kvserver.config", "mlx_kvserver.errors", "mlx_kvserver.flags",
                             "mlx_kvserver.server"]


MODEL_LOADING = {f"mlx_kvserver.models.{m}" for m in (  # every module of models/ but the registry
    "loading", "gguf", "convert", "footprint", "tokenizer", "on_demand", "serving", "vision",
    "image_prompt", "image_preprocessing")} | {  # and each vision family's image reading
    _module_of(p) for p in _files("mlx_kvserver/models/image_families")}


def _beyond_translation(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """The imports of ``path`` (a module of ``api/``) of the cache library or of a module that
    loads, measures or unloads models (``TYPE_CHECKING`` imports are annotations: not counted)."""
    return [(line, m) for line, m in _imports(path, module)
            if m.split(".")[0] == "kv_cache" or m in MODEL_LOADING]


@pytest.mark.parametrize("path", _files("mlx_kvserver/api"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_api_translates_and_leaves_the_cache_and_model_loading_to_others(path):
    """``api/`` translates wire formats: it reaches the cache through the engine
    (``engine/cache_entries.py``), models by name through the registry and the served models it
    is given (``models/serving.py``, loaded at start by ``server.py``), stored responses through
    ``storage/``; never ``kv_cache`` nor the modules of ``models/`` that load models."""
    assert _beyond_translation(path) == []


def test_the_model_loading_modules_are_every_module_of_models_but_the_registry():
    modules = {_module_of(p) for p in _files("mlx_kvserver/models")} - {"mlx_kvserver.models"}
    assert modules - MODEL_LOADING == {"mlx_kvserver.models.registry"}
    assert MODEL_LOADING <= modules


def _cli_imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    return [(line, m) for line, m in _imports(path, module, typing=True)
            if m == "mlx_kvserver.cli"]


@pytest.mark.parametrize("path", _files("mlx_kvserver/clients"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_clients_start_a_server_through_server_py_not_the_cli(path):
    """``mlx-kvchat`` serves in-process through ``server.load_server`` and extends the server's
    flags from ``flags.py``, as ``mlx-kvserver`` (``cli.py``) does: the CLI is an entry point,
    not a library."""
    assert _cli_imports(path) == []


def test_the_api_and_clients_rules_see_a_violation(tmp_path):
    api = tmp_path / "api.py"
    api.write_text("from typing import TYPE_CHECKING\nfrom kv_cache import export_key\n"
                   "from ..models.loading import LoadedModel\nfrom ..models import serving\n"
                   "from ..models.registry import ModelRegistry\nif TYPE_CHECKING:\n"
                   "    from ..models.serving import OnDemand\n")
    assert _beyond_translation(api, "mlx_kvserver.api.x") == [
        (2, "kv_cache"), (3, "mlx_kvserver.models.loading"), (4, "mlx_kvserver.models.serving")]
    client = tmp_path / "client.py"
    client.write_text("from ..cli import build_parser\nfrom .. import cli\n"
                      "from ..server import load_server\nimport mlx_kvserver.cli\n")
    assert _cli_imports(client, "mlx_kvserver.clients.x") == [
        (1, "mlx_kvserver.cli"), (2, "mlx_kvserver.cli"), (4, "mlx_kvserver.cli")]


def test_the_rules_see_a_violation(tmp_path):
    """The checks above read real imports (not an empty list that passes anything): absolute,
    relative (resolved against the file's module) and the package root."""
    src = tmp_path / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mlx_kvserver\n"
                   "from kv_cache.manager import CacheManager\nimport mlx_kvserver.engine\n"
                   "from ..manager import Match\nfrom . import pool\nfrom kv_cache import forward\n")
    assert _imports(src, "kv_cache.pages.x") == [
        (1, "typing"), (4, "kv_cache.manager"), (5, "mlx_kvserver.engine"), (6, "kv_cache.manager"),
        (7, "kv_cache.pages.pool"), (8, "kv_cache")]
    assert _layer("kv_cache.manager") == "top" and "top" not in ALLOWED["pages"]
    assert _layer("kv_cache") == "top" and _layer("kv_cache.layout.spec") == "layout"


def test_an_empty_tree_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="no Python files"):
        _files("kv_cache")


def _naming_proc(paths: list[Path]) -> list[Path]:
    """The files among ``paths`` that name ``/proc`` (Linux's alone: a Mac has none)."""
    return [p for p in paths if "/proc" in p.read_text()]


def test_the_engine_and_its_tests_read_no_proc(tmp_path):
    """The engine and its tests run on a Mac, which has no ``/proc``: the machine's memory is
    read in ``platform/memory_facts.py`` and given to the budget, which tests give a Mac's or
    Linux's figures."""
    paths = _files("mlx_kvserver/engine") + sorted((ROOT / "tests" / "engine").rglob("*.py"))
    assert len(paths) > 20 and not _naming_proc(paths)
    bad = tmp_path / "x.py"
    bad.write_text('total = open("/proc/meminfo").read()\n')
    assert _naming_proc([bad]) == [bad]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of ``graph`` (module -> the modules it imports) that import each other, one
    sorted list per circle (Tarjan's strongly connected components of more than one module, or
    one that imports itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            part = []
            while not part or part[-1] != m:
                part.append(stack.pop())
            if len(part) > 1 or m in graph.get(m, ()):
                out.append(sorted(part))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(out)


def _import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports, ``TYPE_CHECKING`` imports included."""
    paths = {_module_of(p): p for package in packages for p in _files(package)}
    return {m: {n for _, n in _imports(path, m, typing=True) if n in paths and n != m}
            for m, path in paths.items()}


def test_no_module_imports_itself_round_a_circle():
    """No two modules import each other, directly or round a circle of several, not even for
    annotations under ``if TYPE_CHECKING:``: a circle is one idea cut in two halves that call
    each other, or a type that belongs in a module both use (kv_cache/model/reads.py)."""
    graph = _import_graph(("kv_cache", "mlx_kvserver"))
    assert sum(map(len, graph.values())) > 200, "the rule would read too few imports"
    assert _circles(graph) == []


def test_the_circle_rule_sees_a_circle(tmp_path, monkeypatch):
    """A circle closed only by an annotation import is found, and so is one of three."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set(), "c": {"c"}}) == [["c"]]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "one.py").write_text("from pkg.two import Two\n")
    (tmp_path / "pkg" / "two.py").write_text("from typing import TYPE_CHECKING\n"
                                             "if TYPE_CHECKING:\n    from pkg.one import One\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _circles(_import_graph(("pkg",))) == [["pkg.one", "pkg.two"]]


def _names_sys_path(path: Path) -> bool:
    """Whether ``path`` names ``sys.path`` in its code (comments and strings do not count)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(ast.parse(path.read_text(), str(path))))


def test_benchmarks_and_scripts_leave_the_import_path_alone(tmp_path):
    """Benchmarks and tools run from the repository root as modules (``.venv/bin/python -m
    benchmarks.ttft``), which puts the root on the path: none of them edits ``sys.path``."""
    paths = _files("benchmarks") + _files("scripts")
    assert [p.relative_to(ROOT) for p in paths if _names_sys_path(p)] == []
    bad = tmp_path / "x.py"
    bad.write_text("import sys\nsys.path.insert(0, '..')  # sys.path\n")
    assert _names_sys_path(bad)


SHARED_FORBIDDEN = {  # tests, benchmarks and tools share the harness: what each never imports
    "harness": {"tests", "benchmarks", "scripts"},
    "benchmarks": {"tests"},
    "scripts": {"tests"},
}


def _shared_violations(path: Path) -> list[tuple[int, str]]:
    """The imports of ``path`` (in ``benchmarks/``, ``scripts/`` or ``harness/``) of a folder that
    its own never imports (``SHARED_FORBIDDEN``)."""
    here = _module_of(path).split(".")[0]
    return [(line, m) for line, m in _imports(path, typing=True)
            if m.split(".")[0] in SHARED_FORBIDDEN[here]]


@pytest.mark.parametrize("path", _files("harness") + _files("benchmarks") + _files("scripts"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmarks_and_scripts_share_the_harness_not_the_tests(path):
    """Benchmarks and tools reach tiny models, servers and agent sessions through ``harness/``,
    never through ``tests/``; the harness imports neither them nor the tests."""
    assert _shared_violations(path) == []


def test_the_harness_rule_sees_a_violation(tmp_path, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "harness").mkdir()
    bench, harness = tmp_path / "benchmarks" / "x.py", tmp_path / "harness" / "y.py"
    bench.write_text("from harness.tiny_model import make\nfrom tests.tiny_model import make\n"
                     "from scripts import tool\n")
    harness.write_text("import benchmarks.ttft\nfrom scripts import tool\nimport tests\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _shared_violations(bench) == [(2, "tests.tiny_model")]
    assert _shared_violations(harness) == [(1, "benchmarks.ttft"), (2, "scripts"), (3, "tests")]
