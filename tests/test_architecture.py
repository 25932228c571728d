"""The package's layers (docs/architecture.md): which sub-package may import which, no import cycles, and a fast
``import shardlib`` that loads no torch, no transformers and no model code until a name is used."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: where each part of the package installs from (policies/ and kernels/ live at the root: pyproject package-dir)
SOURCES = {"shardlib": ROOT / "shardlib", "shardlib.policies": ROOT / "policies", "shardlib.kernels": ROOT / "kernels"}
#: layer of each part, lowest first; a part is a package or module, and a module belongs to the longest part that
#: prefixes its name (``shardlib.sharding.plan`` is its own part, below the rest of ``shardlib.sharding``). A module
#: imports from its own part and from parts of strictly lower layers only, lazy imports inside functions included
LAYERS = {
    "shardlib._lazy": 0, "shardlib.parallel": 0, "shardlib.safetensors_io": 0,
    "shardlib.kernels": 1,
    "shardlib.sharding.plan": 2,
    "shardlib.pipeline": 3, "shardlib.policies": 3,
    "shardlib.sharding": 4,
    "shardlib.analysis": 5, "shardlib.checkpoint": 5,
    "shardlib.train": 6,
    "shardlib.cli": 7,
}
#: the package itself: its lazy table names every layer (and it imports only ``_lazy``), so only the top layer may
#: import it (``shardlib.cli`` reads ``__version__``)
PACKAGE = "shardlib"


def _modules(sources: dict[str, Path] = SOURCES) -> dict[str, Path]:
    """Every module of the installed package by its dotted name."""
    out = {}
    for package, folder in sources.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1], *(() if parts[-1] == "__init__" else (parts[-1],))))
            if package == PACKAGE and len(parts) > 1 and f"{PACKAGE}.{parts[0]}" in sources:
                continue
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, modules: dict[str, Path] = MODULES) -> list[tuple[str, bool]]:
    """(imported shardlib module, at module level) for every import statement of module ``name``, the lazy ones
    inside functions included; ``from pkg import sub`` counts as importing the submodule when it is one."""
    tree = ast.parse(modules[name].read_text())
    is_package = modules[name].name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, id(node) in top))
    return out


def _part(name: str) -> str:
    return max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=name)


def _layer(name: str) -> int:
    """The layer of what importing ``name`` gives: its part's (the package itself: the top, its table names all)."""
    return max(LAYERS.values()) if name == PACKAGE else LAYERS[_part(name)]


def _floor(name: str, modules: dict[str, Path]) -> int:
    """The highest layer module ``name``'s imports may reach: its part's, but a package's ``__init__`` runs whenever
    any module under it is imported, so it may reach no higher than the lowest part inside it (``shardlib.sharding``
    holds ``sharding.plan``: importing the plan must not load the compiler)."""
    inside = [layer for part, layer in LAYERS.items() if part.startswith(name + ".")]
    return min([LAYERS[_part(name)], *inside]) if modules[name].name == "__init__.py" else LAYERS[_part(name)]


def upward_imports(modules: dict[str, Path] = MODULES) -> list[str]:
    """Every import (lazy ones included) that is not to the importer's own part or a strictly lower layer."""
    found = []
    for name in modules:
        if name == PACKAGE:
            continue
        floor = _floor(name, modules)
        for target, _ in _imports(name, modules):
            layer = _layer(target)
            if layer < floor or ((_part(target) == _part(name) or target == PACKAGE) and layer <= floor):
                continue
            why = "the same layer" if layer == floor else "a higher layer"
            found.append(f"{name} (layer {floor}) imports {target} (layer {layer}: {why})")
    return sorted(set(found))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> a``) through each group of nodes that reach each other (Tarjan's components)."""
    index, low, stack, out = {}, {}, [], []

    def component(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                component(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(members) > 1:
                out.append(_cycle_in(graph, node, members))

    for node in sorted(graph):
        if node not in index:
            component(node)
    return out


def _cycle_in(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``members`` (breadth first)."""
    came = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while came[path[-1]] is not None:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if nxt not in came:
                    came[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def import_cycles(modules: dict[str, Path] = MODULES) -> tuple[list[list[str]], list[list[str]]]:
    """The cycles of the import graph of modules (lazy imports included) and of the graph of parts, one through each
    group of nodes that reach each other. Importing a module runs its packages' ``__init__`` first, so a module's
    import edge also leads to every parent package (but for the importer's own packages, which are already being
    initialized)."""
    graph, parts = {}, {}
    for name in modules:
        edges = set()
        for target, _ in _imports(name, modules):
            items = target.split(".")
            edges |= {".".join(items[:i]) for i in range(2, len(items) + 1)
                      if not name.startswith(".".join(items[:i]) + ".") and ".".join(items[:i]) != name}
            if name != PACKAGE and target != PACKAGE and _part(target) != _part(name):
                parts.setdefault(_part(name), set()).add(_part(target))
        graph[name] = edges & set(modules)
    parts = {p: parts.get(p, set()) for p in set(parts) | {t for ts in parts.values() for t in ts}}
    return _cycles(graph), _cycles(parts)


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in MODULES if m != PACKAGE and _part(m) not in LAYERS)
    assert not unplaced, f"modules in no layer of LAYERS (add them, and to docs/architecture.md): {unplaced}"


def test_every_import_goes_to_its_own_part_or_a_lower_layer():
    """Lazy imports inside functions included: a lazy import up the layers is still a dependency up the layers."""
    upward = upward_imports()
    assert not upward, "\n".join(upward)


def test_imports_have_no_cycle():
    """No module reaches itself through imports, lazy ones included, and no part reaches itself through another."""
    modules, parts = import_cycles()
    assert not modules and not parts, "\n".join(" -> ".join(cycle) for cycle in modules + parts)


def test_the_rules_catch_lazy_cycles_same_layer_imports_and_eager_package_inits(tmp_path):
    """The checks themselves, on a made-up package: a lazy import back into the sharder, an import between two
    parts of one layer, an import up, and a package ``__init__`` that loads its compiler when its plan is imported."""
    tree = {
        "__init__.py": "from ._lazy import lazy_attributes\n",
        "_lazy.py": "",
        "parallel/__init__.py": "",
        "sharding/__init__.py": "from . import sharder\n",
        "sharding/plan.py": "from ..parallel import mesh\n",
        "sharding/sharder.py": "def shard():\n    from .inference.verify import verify\n",
        "sharding/inference/__init__.py": "",
        "sharding/inference/verify.py": "def verify():\n    from ..sharder import shard\n",
        "pipeline/__init__.py": "def split():\n    from shardlib.policies import bert\n",
        "policies/__init__.py": "",
        "policies/bert.py": "",
        "checkpoint/__init__.py": "def load():\n    from ..train.optim import param_state\n",
        "train/__init__.py": "",
        "train/optim.py": "from ..checkpoint import load\n",
    }
    for path, text in tree.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    modules = _modules({PACKAGE: tmp_path})
    upward = upward_imports(modules)
    assert any(u.startswith("shardlib.pipeline (layer 3) imports shardlib.policies.bert (layer 3: the same layer)")
               for u in upward), upward
    assert any(u.startswith("shardlib.checkpoint (layer 5) imports shardlib.train.optim") for u in upward), upward
    assert any(u.startswith("shardlib.sharding (layer 2) imports shardlib.sharding.sharder") for u in upward), upward
    cycles, part_cycles = import_cycles(modules)
    assert {frozenset(c) for c in cycles} == {
        frozenset({"shardlib.sharding.sharder", "shardlib.sharding.inference.verify"}),
        frozenset({"shardlib.checkpoint", "shardlib.train.optim"})}, cycles
    assert [set(c) for c in part_cycles] == [{"shardlib.checkpoint", "shardlib.train"}], part_cycles


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


HEAVY = ("torch", "transformers", "numpy", "safetensors")
LOADED = "import json, sys; print(json.dumps(sorted(sys.modules)))"


def test_import_shardlib_loads_nothing_heavy():
    loaded = _python(f"import shardlib; {LOADED}")
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]
    assert [m for m in loaded if m.startswith("shardlib")] == ["shardlib", "shardlib._lazy"]


def test_the_cli_parser_and_version_load_no_torch():
    loaded = _python("import contextlib, io, shardlib.cli as cli\n"
                     "for argv in (['--help'], ['--version'], ['plan', '--help'], ['convert', '--help']):\n"
                     "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                     f"        cli.main(argv)\n{LOADED}")
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


def test_no_policy_and_no_model_code_until_a_lookup_needs_one():
    """``shardlib.shard`` loads transformers' machinery (its attention interface, the auto-config tables) but no
    model family and no policy; a lookup imports the one policy it needs (one subprocess: torch is slow to load)."""
    before, after = _python(
        "import json, sys, shardlib\nshardlib.shard; shardlib.Trainer; shardlib.plan\nbefore = sorted(sys.modules)\n"
        "from shardlib.policies import policy_for_class_name\nassert policy_for_class_name('ViTModel').name == 'vit'\n"
        "print(json.dumps([before, sorted(sys.modules)]))")
    families = {m.split(".")[2] for m in before if m.startswith("transformers.models.")} - {"auto"}
    assert not families and not [m for m in before if m.startswith("shardlib.policies.")]
    assert [m for m in after if m.startswith("shardlib.policies.")] == ["shardlib.policies.vit"]


def test_importing_a_layer_loads_nothing_above_it():
    """What the import statements promise, at run time: every part imported in layer order (one subprocess), the
    modules loaded so far are of that layer or below (a package ``__init__`` counting at the lowest part inside)."""
    order = sorted(LAYERS, key=LAYERS.get)
    steps = _python("import importlib, json, sys\nloaded = []\n"
                    f"for part in {order!r}:\n    importlib.import_module(part)\n"
                    "    loaded.append(sorted(m for m in sys.modules if m.startswith('shardlib.')))\n"
                    "print(json.dumps(loaded))")
    for part, loaded in zip(order, steps):
        above = [m for m in loaded if m in MODULES and _floor(m, MODULES) > LAYERS[part]]
        assert not above, f"importing {part} (layer {LAYERS[part]}) loaded {above}"


def test_builtin_policy_names_are_the_classes_they_register():
    from shardlib.policies import BUILTIN, registered_classes

    registered = {cls.__name__ for cls in registered_classes()}
    assert registered == {name for names in BUILTIN.values() for name in names}


def test_every_public_name_resolves_and_lazy_names_shadow_no_submodule():
    import importlib

    import shardlib

    for package in ("shardlib", "shardlib.parallel", "shardlib.sharding", "shardlib.analysis", "shardlib.train"):
        module = importlib.import_module(package)
        for name in module.__all__:
            assert getattr(module, name) is not None, (package, name)
    assert callable(shardlib.plan) and callable(shardlib.export.export) and callable(shardlib.train.fit)


def test_a_lazy_name_that_a_submodule_would_shadow_is_refused(tmp_path, monkeypatch):
    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "fit.py").write_text("def fit(): pass\n")
    (package / "__init__.py").write_text("from shardlib._lazy import lazy_attributes\n"
                                         "__getattr__, __dir__ = lazy_attributes(__name__, {'fit': ['fit']})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"lazy names \['fit'\] are also submodules"):
        import lazypkg  # noqa: F401
