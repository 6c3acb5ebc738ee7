"""The package map, derived from the tree (everything else is in pyproject.toml).

One import namespace: every top-level folder with an ``__init__.py`` installs as
``kvproof.<folder>`` (``spec/`` -> ``kvproof.spec``), and every folder below it with an
``__init__.py`` as its sub-package, so a package added anywhere lands in the wheel without a
list to keep (tests/packaging/test_wheel.py builds the wheel and checks it holds every module).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def package_map() -> dict[str, str]:
    """``{package name: folder relative to the root}`` for every package of the tree."""
    packages = {"kvproof": "kvproof"}
    for top in sorted(ROOT.iterdir()):
        if top.name == "kvproof" or not (top / "__init__.py").is_file():
            continue
        for init in sorted(top.rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT)
            if all((ROOT / Path(*folder.parts[:i]) / "__init__.py").is_file() for i in range(1, len(folder.parts) + 1)):
                packages[".".join(("kvproof", *folder.parts))] = folder.as_posix()
    return packages


PACKAGES = package_map()
setup(packages=list(PACKAGES), package_dir=PACKAGES)
