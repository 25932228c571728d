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
#: layer of each part, lowest first; a module may import from its own layer and the layers below
LAYERS = {
    "shardlib._lazy": 0, "shardlib.parallel": 0, "shardlib.safetensors_io": 0,
    "shardlib.kernels": 1,
    "shardlib.sharding": 2, "shardlib.policies": 2, "shardlib.pipeline": 2,
    "shardlib.analysis": 3,
    "shardlib.train": 4, "shardlib.checkpoint": 4,
    "shardlib.cli": 5,
}


def _modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name."""
    out = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1], *(() if parts[-1] == "__init__" else (parts[-1],))))
            if package == "shardlib" and len(parts) > 1 and f"shardlib.{parts[0]}" in SOURCES:
                continue
            out[name] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported shardlib module, at module level) for every import statement of module ``name``, the lazy ones
    inside functions included; ``from pkg import sub`` counts as importing the submodule when it is one."""
    tree = ast.parse(MODULES[name].read_text())
    package = name.split(".") if _is_package(name) else name.split(".")[:-1]
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names if a.name.split(".")[0] == "shardlib"]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            if base.split(".")[0] != "shardlib":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in MODULES else base, id(node) in top))
    return out


def _part(name: str) -> str:
    return max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=name)


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in MODULES if m != "shardlib" and _part(m) not in LAYERS)
    assert not unplaced, f"modules in no layer of LAYERS (add them, and to docs/architecture.md): {unplaced}"


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for name in MODULES:
        if name == "shardlib":  # the package's lazy table names every layer, and imports none of them
            continue
        for target, _ in _imports(name):
            if target != "shardlib" and LAYERS[_part(target)] > LAYERS[_part(name)]:
                upward.append(f"{name} (layer {LAYERS[_part(name)]}) imports {target} "
                              f"(layer {LAYERS[_part(target)]})")
    assert not upward, "\n".join(upward)


def test_module_level_imports_have_no_cycle():
    """Importing a module runs its packages' __init__ first, so an import edge also leads to every parent (but for
    the importer's own packages, which are already being initialized)."""
    graph = {}
    for name in MODULES:
        edges = set()
        for target, at_top in _imports(name):
            if at_top:
                parts = target.split(".")
                edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)
                          if not name.startswith(".".join(parts[:i]) + ".") and ".".join(parts[:i]) != name}
        graph[name] = edges & set(MODULES)
    state, cycle = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open" and not cycle:
                cycle.extend(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycle, " -> ".join(cycle)


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
