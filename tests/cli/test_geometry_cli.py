"""``kvproof geometry``: the issue's worked example, JSON shape, presets and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvproof.cli.main import main
from kvproof.cli.presets import PRESETS

SEED = ["--group", "full_attention:1536", "--group", "mamba:16", "--dcp", "8", "--max-model-len", "1048576"]


def run_cli(capsys, *argv):
    code = main(["geometry", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_seed_example_json(capsys):
    code, out, _ = run_cli(capsys, *SEED, "--json")
    assert code == 0
    data = json.loads(out)
    assert [g["max_num_blocks_per_req"] for g in data["groups"]] == [86, 65_536]
    assert [g["table_width"] for g in data["groups"]] == [86, 65_536]
    assert [g["dcp_sharded"] for g in data["groups"]] == [True, False]
    assert [g["effective_block_size"] for g in data["groups"]] == [12_288, 16]
    assert data["scheduler_block_size"] == 12_288
    assert data["hash_block_size"] == 16
    assert data["partial_hash_hits"] is True
    assert data["cache_hit_alignment"] == 16
    assert data["warnings"] == []
    for key in ("kind", "block_size", "effective_block_size", "dcp_sharded", "max_num_blocks_per_req", "table_width"):
        assert all(key in g for g in data["groups"])


def test_seed_example_table(capsys):
    code, out, _ = run_cli(capsys, *SEED)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["group", "kind", "block"]
    assert "86" in lines[1].split() and "65,536" in lines[2].split()


def test_default_is_a_preset(capsys):
    code, out, _ = run_cli(capsys, "--json")
    assert code == 0
    assert json.loads(out)["groups"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves(capsys, name):
    code, out, _ = run_cli(capsys, "--preset", name, "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["groups"]) == len(PRESETS[name].groups)


def test_fallback_warning_is_reported(capsys):
    code, out, _ = run_cli(capsys, "--preset", "hymba", "--json")
    data = json.loads(out)
    assert code == 0 and data["partial_hash_hits"] is False
    assert data["cache_hit_alignment"] == data["scheduler_block_size"]
    assert any("sliding_window:64" in w for w in data["warnings"])


def test_mamba_flags_override_every_mamba_group(capsys):
    code, out, _ = run_cli(capsys, *SEED, "--mamba-cache-mode", "none", "--num-speculative-blocks", "7", "--json")
    assert code == 0
    assert [g["max_num_blocks_per_req"] for g in json.loads(out)["groups"]] == [86, 8]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--group", "full_attention:64", "--group", "mamba:64", "--dcp", "2", "--hash-block-size", "24"],
         "hash_block_size 24 does not divide effective block size 128 of group 0"),
        (["--group", "full_attention:0"], "block size 0"),
        (["--group", "full_attention:-16"], "block size -16"),
        (["--group", "gqa:16"], "unknown group kind 'gqa'"),
        (["--group", "sliding_window:16", "--group", "mamba:16", "--dcp", "2"], "DCP-sharded sliding window"),
        (["--dcp", "0"], "dcp 0"),
        (["--max-model-len", "-5"], "max_model_len -5"),
        (["--group", "mamba"], "must look like KIND:BLOCK_SIZE"),
        (["--group", "mla:16:fast"], "unknown option 'fast'"),
        (["--group", "full_attention:16", "--group", "mamba:16", "--dcp", "2", "--interleave", "3"], "interleave 3"),
        (["--dcp", "two"], "argument --dcp: 'two' is not a decimal integer"),
        (["--preset", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    try:
        code = main(["geometry", *argv])
    except SystemExit as exit_:  # argparse-level errors (bad int, bad choice)
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err
    assert "Traceback" not in err


def test_console_script_runs_without_torch_and_without_traceback():
    """The installed entry point works and bad input never prints a traceback."""
    ok = subprocess.run([sys.executable, "-m", "kvproof", "geometry", *SEED, "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["groups"][1]["table_width"] == 65_536
    bad = subprocess.run([sys.executable, "-m", "kvproof", "geometry", "--group", "x:1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.splitlines()) == 1
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, kvproof.cli.main as m; m.main(['geometry', '--json']); print('torch' in sys.modules, file=sys.stderr)"],
        capture_output=True, text=True,
    )
    assert probe.stderr.strip().endswith("False"), "the geometry command must not import torch"
