"""A command that needs a missing optional extra exits 2 before any work, with one line naming
the extra and the exact install command (``kvproof.extras``); exit 70 stays for bugs.

The extra is made missing in a subprocess: ``sys.modules[name] = None`` makes every import of
``name`` (and of its submodules) raise ImportError, as if it were not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvproof.extras import EXTRAS, message

ROOT = Path(__file__).resolve().parents[2]
TRACE = str(ROOT / "examples" / "k3-prime-replay.jsonl")

CASES = [
    # (modules made missing, argv, the extra, what needs it)
    (("z3",), ["prove"], "proofs", "this command"),
    (("crosshair",), ["prove", "--only", "EXH-LAYOUT"], "proofs", "this command"),
    (("torch",), ["e2e", TRACE], "kernels", "this command"),
    (("matplotlib",), ["plan", "--plot", "x.png", "--no-progress"], "plot", "--plot"),
    (("vllm",), ["plan", "--engine", "vllm", "--no-progress"], "vllm", "--engine vllm"),
]


def _run_without(modules: tuple[str, ...], argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    probe = (
        "import sys\n"
        f"for m in {list(modules)!r}: sys.modules[m] = None\n"
        "from kvproof.cli.main import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    env = {**os.environ, "ICONTRACT_SLOW": "0", "KVPROOF_DEBUG": ""}
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize("modules, argv, extra, needed_by", CASES, ids=[" ".join(c[1][:3]) for c in CASES])
def test_a_missing_extra_is_bad_input_named_with_its_install_command(modules, argv, extra, needed_by, tmp_path):
    done = _run_without(modules, argv, tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # before any work: no table, no progress
    prog = f"kvproof {argv[0]}"
    assert done.stderr == f"{prog}: error: {message(extra, needed_by)}\n"
    assert EXTRAS[extra].install in done.stderr
    assert not list(tmp_path.iterdir())  # nothing written (no plot file)


def test_every_extra_named_is_declared_in_pyproject():
    """Each install command installs the extra it names, and that extra exists."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for e in EXTRAS.values():
        assert e.name in declared, e.name
        if e.name != "vllm":  # on a CPU machine vLLM goes in with --no-deps (docs/vllm.md)
            assert f'".[{e.name}]"' in e.install


def test_the_extras_import_when_installed():
    """The suite's environment has every extra (the README's test command installs them):
    ``require`` passes, so the cases above fail for the module they block and nothing else."""
    from kvproof.extras import require

    for name in EXTRAS:
        require(name, "test")


def test_a_bug_inside_an_extras_command_is_still_exit_70(tmp_path):
    """A missing module of kvproof's own (a packaging bug) is not reported as a missing extra."""
    done = _run_without(("kvproof.e2e.runner",), ["e2e", TRACE], tmp_path)
    assert done.returncode == 70, done.stderr
    assert "a bug in kvproof" in done.stderr
