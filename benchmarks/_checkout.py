"""Importing this installs shardlib from this checkout without ``pip install`` (the GPU machine runs a plain copy):
``shardlib.kernels`` -> kernels/, ``shardlib.policies`` -> policies/, as pyproject's package-dir maps them."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

#: ``SHARDLIB_CHECKOUT``: another checkout to import instead (a benchmark's baseline ranks: ``git worktree add`` of the
#: commit before a change, timed in the same run as this one)
ROOT = Path(os.environ.get("SHARDLIB_CHECKOUT") or Path(__file__).resolve().parent.parent).resolve()


class _RepoLayout(importlib.abc.MetaPathFinder):
    DIRS = {"shardlib.kernels": ROOT / "kernels", "shardlib.policies": ROOT / "policies"}

    def find_spec(self, name, path=None, target=None):
        directory = self.DIRS.get(name)
        if directory is None or not (directory / "__init__.py").exists():
            return None
        return importlib.util.spec_from_file_location(name, directory / "__init__.py",
                                                      submodule_search_locations=[str(directory)])


if (ROOT / "shardlib" / "__init__.py").exists() and not any(isinstance(f, _RepoLayout) for f in sys.meta_path):
    sys.path.insert(0, str(ROOT))
    sys.meta_path.insert(0, _RepoLayout())
