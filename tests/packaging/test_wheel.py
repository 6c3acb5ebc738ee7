"""The wheel a user installs (``pip install .``) holds every module of the source tree, and its
commands run from the installed wheel, not from this checkout.

The wheel is built from a copy of the tree's files (tracked, or new and not ignored), so a stale
``build/`` folder cannot hide a module the package map misses. It is installed with
``--target`` into a temporary folder and run under ``python -S``: no site-packages ``.pth``
files, so the editable install of this checkout (whose finder resolves any ``kvproof.*`` name
to the checkout) cannot answer an import the wheel fails to satisfy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Top-level folders and files that are not part of the installed package.
NOT_SHIPPED = {"tests", "benchmarks", "tools", "docs", "examples", "requirements", ".ci", "setup.py", "pyproject.toml"}
#: Shipped-folder files that stay out of the wheel on purpose: folder READMEs (except those
#: declared as package data) and the C source of the optional native extension.
NOT_IN_WHEEL_SUFFIXES = (".c",)


def _tree_files() -> list[str]:
    """The repository's files (tracked, plus new ones git does not ignore), relative paths."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    return sorted({p for p in out.split("\0") if p and (ROOT / p).is_file()})


def _installed_name(path: str) -> str:
    """A shipped file's name in the wheel: its path in the tree, under the wheel's ``kvproof`` folder
    (where the root package's own files already are)."""
    return path if path.startswith("kvproof/") else f"kvproof/{path}"


def _shipped(files: list[str]) -> list[str]:
    return [p for p in files if "/" in p and p.split("/", 1)[0] not in NOT_SHIPPED and not p.startswith(".")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the tree (no network: the build uses this venv's setuptools)."""
    src = tmp_path_factory.mktemp("src")
    for p in _tree_files():
        (src / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / p, src / p)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [whl] = out.glob("kvproof-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return target


def _run_installed(target: Path, tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -S`` with the wheel's folder first and this environment's site-packages (the
    dependencies) after it; run outside the checkout, so ``kvproof/`` in the working directory
    cannot be imported either."""
    paths = dict.fromkeys([str(target), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join(paths), "ICONTRACT_SLOW": "0",
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "",  # vLLM's CPU platform; no plugin loading on import
    }
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


def test_the_wheel_holds_every_module_and_data_file_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = _shipped(_tree_files())
    modules = [p for p in shipped if p.endswith(".py")]
    assert len(modules) >= 100 and "impl/managers/base.py" in modules  # the tree was read
    missing = [p for p in modules if _installed_name(p) not in names]
    assert not missing, f"modules missing from the wheel: {missing}"
    data = [p for p in shipped if not p.endswith(".py") and not p.endswith(NOT_IN_WHEEL_SUFFIXES) and not p.endswith("README.md")]
    missing = [p for p in data if _installed_name(p) not in names]
    assert not missing, f"data files missing from the wheel (declare them in pyproject's package-data): {missing}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvproof = kvproof.cli.main:main" in text and "kvproof.integrations.vllm.plugin:register" in text


def test_a_new_sub_package_lands_in_the_wheel_without_editing_a_list(tmp_path):
    """setup.py's package map is derived from the folders: a folder with an ``__init__.py``
    anywhere under a package (or a new top-level one) is a package."""
    for rel in ("spec/newsub/__init__.py", "newtop/__init__.py", "newtop/deeper/__init__.py", "notapkg/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for rel in ("kvproof/__init__.py", "spec/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    shutil.copy2(ROOT / "setup.py", tmp_path / "setup.py")
    probe = "import setuptools, runpy, json; setuptools.setup = lambda **kw: print(json.dumps(kw['package_dir'])); runpy.run_path('setup.py')"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "kvproof": "kvproof", "kvproof.newtop": "newtop", "kvproof.newtop.deeper": "newtop/deeper",
        "kvproof.spec": "spec", "kvproof.spec.newsub": "spec/newsub",
    }


def test_the_commands_run_from_the_installed_wheel(installed, tmp_path):
    script = installed / "bin" / "kvproof"
    done = _run_installed(installed, tmp_path, str(script), "plan", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: kvproof plan" in done.stdout
    trace = tmp_path / "t.jsonl"
    trace.write_text((ROOT / "examples" / "k3-prime-replay.jsonl").read_text())
    done = _run_installed(installed, tmp_path, str(script), "replay", str(trace), "--group", "full_attention:256",
                          "--group", "mamba:256", "--dcp", "2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["violations"] == []
    assert [r["num_cached_tokens"] for r in result["requests"]] == [0, 256]  # docs/replay.md's example


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    """Every module the wheel ships imports from it -- the vLLM CPU staging executor among them
    (the README's test command installs vLLM) -- and nothing is loaded from the checkout."""
    probe = (
        "import importlib, pathlib, pkgutil, sys, json\n"
        "import kvproof\n"
        "root = pathlib.Path(kvproof.__file__).parent\n"
        "names = sorted(m.name for m in pkgutil.walk_packages([str(root)], 'kvproof.') if m.name != 'kvproof.__main__')\n"
        "failed = {}\n"
        "for n in names:\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception as e:\n"
        "        failed[n] = repr(e)\n"
        "outside = sorted(n for n, m in sys.modules.items() if n.startswith('kvproof') and getattr(m, '__file__', None)"
        " and not pathlib.Path(m.__file__).resolve().is_relative_to(root.resolve()))\n"
        "print(json.dumps({'root': str(root), 'names': names, 'failed': failed, 'outside': outside}))\n"
    )
    done = _run_installed(installed, tmp_path, "-c", probe, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["root"]).resolve().is_relative_to(installed.resolve())
    assert "kvproof.integrations.vllm.cpu_executor" in report["names"] and "kvproof.impl.managers.base" in report["names"]
    assert report["failed"] == {}
    assert report["outside"] == []
