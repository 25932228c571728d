"""Lazy attributes for a package (PEP 562): ``import shardlib`` costs milliseconds, and each name loads its
module (and torch, transformers) the first time it is used.

    __getattr__, __dir__ = lazy_attributes(__name__, {"parallel.mesh": ["Mesh", "init_mesh"]},
                                           modules={"export": "analysis.export"})

``names``: relative module -> the names it gives the package; ``modules``: an attribute that is a module.
A resolved attribute is stored on the package, so each costs one import and later lookups are plain. No name may
also be a submodule's: importing ``package.fit`` binds ``package.fit`` to the module, which would then hide a lazy
function ``fit`` for good (refused here, at import).
"""

from __future__ import annotations

import importlib
import os
import sys


def lazy_attributes(package: str, names: dict[str, list[str]], modules: dict[str, str] | None = None):
    home = {name: module for module, exported in names.items() for name in exported}
    submodules = dict(modules or {})
    both = set(home) & set(submodules)
    if both:
        raise ValueError(f"{package}: {sorted(both)} named both as an attribute and as a module")
    shadowed = set(home) & _submodule_names(sys.modules[package].__path__)
    if shadowed:
        raise ValueError(f"{package}: lazy names {sorted(shadowed)} are also submodules, whose import would hide them")

    def __getattr__(name: str):
        if name in submodules:
            value = importlib.import_module(f"{package}.{submodules[name]}")
        elif name in home:
            value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home) | set(submodules))

    return __getattr__, __dir__


def _submodule_names(path: list[str]) -> set[str]:
    """The modules and packages in a package's folders (``pkgutil.iter_modules`` would import ``inspect``)."""
    names = set()
    for folder in path:
        for entry in os.scandir(folder):
            if entry.name.endswith(".py"):
                names.add(entry.name[:-3])
            elif entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py")):
                names.add(entry.name)
    return names
