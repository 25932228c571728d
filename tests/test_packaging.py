"""Packaging: the declared ranges, the constraints file, requires-python, license and URLs, and what a wheel built
from this tree ships (every package, ``py.typed``, the license)."""

import importlib.metadata
import importlib.resources
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
META = PROJECT["project"]
LOWEST_PYTHON = "3.11"  # transformers 5.23 and numpy 2.4 need it


def _tested_extras() -> list[str]:
    """The extras `make` installs (with -c constraints.txt): the ones the suite runs with."""
    match = re.search(r'-c constraints\.txt -e "\.\[([\w,-]+)\]"', (ROOT / "Makefile").read_text())
    assert match, "the Makefile no longer installs the project with -c constraints.txt"
    return match.group(1).split(",")


def _declared() -> list[Requirement]:
    """Every dependency and every dependency of a tested extra."""
    extras = META["optional-dependencies"]
    return [Requirement(r) for r in META["dependencies"] + [r for e in _tested_extras() for r in extras[e]]]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.-]+", name) and "," not in version, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_declared_ranges_hold_the_installed_versions():
    for requirement in _declared():
        installed = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), (str(requirement), installed)
    assert not any(r.specifier.contains("2.12.9") for r in _declared() if r.name == "torch")  # a range, tested


def test_constraints_pin_every_declared_dependency_at_the_installed_version():
    pins, declared = _pins(), _declared()
    assert set(pins) == {canonicalize_name(r.name) for r in declared}, "constraints.txt and pyproject.toml differ"
    for requirement in declared:
        pin = pins[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(pin, prereleases=True), (str(requirement), str(pin))
        installed = importlib.metadata.version(requirement.name)  # torch: 2.13.0+cpu matches ==2.13.0
        assert SpecifierSet(f"=={pin}").contains(installed, prereleases=True), (requirement.name, str(pin), installed)


def test_requires_python_is_what_the_dependencies_need():
    ours = SpecifierSet(META["requires-python"])
    assert ours.contains(platform.python_version()) and ours.contains(f"{LOWEST_PYTHON}.0")
    assert not ours.contains("3.10.99"), "transformers 5.23 and numpy 2.4 do not install on Python 3.10"
    for requirement in _declared():  # the lowest Python we claim installs every tested dependency
        theirs = importlib.metadata.metadata(requirement.name).get("Requires-Python") or ""
        assert SpecifierSet(theirs).contains(f"{LOWEST_PYTHON}.0"), (requirement.name, theirs)
    for classifier in META["classifiers"]:
        if match := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", classifier):
            assert ours.contains(f"{match.group(1)}.0"), classifier


def test_license_urls_and_typed_marker():
    assert META["license"] == "Apache-2.0" and META["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert not any(c.startswith("License ::") for c in META["classifiers"])  # PEP 639: the expression only
    assert "Typing :: Typed" in META["classifiers"]
    assert all(url.startswith("https://") for url in META["urls"].values()) and "Source" in META["urls"]
    assert importlib.resources.files("shardlib").joinpath("py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["shardlib"]


def _package_directories() -> dict[str, Path]:
    """Every package of the source tree (a directory with ``__init__.py``) by the name it installs under."""
    out = {}
    for name, directory in PROJECT["tool"]["setuptools"]["package-dir"].items():
        root = ROOT / directory
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if "__pycache__" not in parts and not (name == "shardlib" and parts[:1] in (("policies",), ("kernels",))):
                out[".".join([name, *parts])] = init.parent
    return out


def test_every_package_directory_is_listed():
    listed = PROJECT["tool"]["setuptools"]["packages"]
    missing = sorted(set(_package_directories()) - set(listed))
    assert not missing, f"packages not listed in pyproject.toml [tool.setuptools] packages (a wheel would lack " \
                        f"them): {missing}"


def test_wheel_ships_every_package_py_typed_and_the_license(tmp_path):
    """A wheel built from (a copy of) this tree, without build isolation: no index needed, about 2 s."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for directory in ("shardlib", "policies", "kernels"):
        shutil.copytree(ROOT / directory, source / directory, ignore=ignore)
    for file in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / file, source / file)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = zipfile.ZipFile(tmp_path / "dist" / done.stdout.split()[-1])
    names = set(wheel.namelist())
    for package in _package_directories():
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert {"shardlib/py.typed", "shardlib/policies/bert.py", "shardlib/cli.py"} <= names
    dist_info = f"shardlib-{META['version']}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and f"Requires-Python: {META['requires-python']}" in metadata
    assert re.search(r"^Requires-Dist: torch<2\.14,>=2\.13$", metadata, re.M), metadata[:2000]
    assert "shardlib = shardlib.cli:main" in wheel.read(f"{dist_info}/entry_points.txt").decode()
