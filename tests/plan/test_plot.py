"""``--plot``: a valid PNG with the expected axes and series, written whole or not at all."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from kvproof import leftovers  # noqa: E402
from kvproof.cli.main import main  # noqa: E402
from kvproof.extras import message  # noqa: E402
from kvproof.planner.plot import TEMP_PREFIX, build_figure, save_plot  # noqa: E402
from kvproof.planner.run import ConfigReport  # noqa: E402


def report(dcp: int, hit: float, gib: float = 1.0) -> ConfigReport:
    return ConfigReport(
        dcp=dcp, kv_memory_bytes=int(gib * 2**30), num_blocks=1000, block_bytes=2**20, hash_block_size=16,
        cache_hit_alignment=16, requests=10, prompt_tokens=1000, cached_tokens=int(1000 * hit), requests_with_hit=5,
        prefill_tokens=900, cow_copies=0, evictions=0, preemptions=0, steps=10,
        attention_cached_tokens=int(1000 * hit) + 50, peak_blocks_per_group=None, table_bytes_per_group=[4096, 8192],
        largest_request=4096, violations=[], seconds=0.1,
    )


def series(ax) -> dict[str, list]:
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_figure_axes_and_series():
    reports = [report(1, 0.2), report(2, 0.15)]
    sweep = [report(1, 0.1, 0.5), report(1, 0.2), report(2, 0.12, 0.5), report(2, 0.15)]
    fig = build_figure(reports, sweep, "title")
    hit, memory, capacity, tables = fig.axes
    assert (hit.get_xlabel(), hit.get_title()) == ("DCP size", "hit rate vs DCP size")
    assert series(hit) == {"hit rate": [20.0, 15.0], "attention groups alone": [25.0, 20.0]}
    assert list(hit.get_lines()[0].get_xdata()) == [1, 2]
    assert (memory.get_ylabel(), set(series(memory))) == ("GiB per GPU", {"KV pool"})  # no peak: not measured
    assert capacity.get_xlabel() == "KV memory per GPU (GiB)" and capacity.get_title() == "hit rate vs KV memory"
    assert series(capacity) == {"DCP 1": [10.0, 20.0], "DCP 2": [12.0, 15.0]}
    assert len(build_figure(reports, [], "t").axes) == 3  # no sweep, no third panel (the tables' axis stays)


def test_block_tables_are_drawn_in_mib_on_their_own_axis():
    """4 and 8 KiB of tables beside a 1 GiB pool: in GiB they would all round to the floor."""
    fig = build_figure([report(1, 0.2), report(2, 0.15)], [], "t")
    memory, tables = fig.axes[1], fig.axes[2]
    assert tables.get_ylabel() == "block tables, MiB per GPU"
    assert series(tables) == {"block tables (right axis)": [12 * 1024 / 2**20] * 2}
    low, high = tables.get_ylim()
    assert low == 0 and high > 12 * 1024 / 2**20  # the line sits inside the axis, not on its floor
    assert tables.get_shared_x_axes().joined(tables, memory)


def test_peak_in_use_is_the_peak_of_the_total_and_never_above_the_pool():
    """Per-group peaks that do not coincide sum past the pool (600 + 700 > 1,000 blocks); the
    curve is the peak of all groups together, as the replay measured it."""
    import dataclasses

    runs = [dataclasses.replace(report(d, 0.2), peak_blocks_per_group=[600, 700], peak_blocks=peak)
            for d, peak in ((1, 999), (2, 800))]
    memory = build_figure(runs, [], "t").axes[1]
    drawn = series(memory)
    assert drawn["KV pool"] == [1000 * 2**20 / 2**30] * 2
    assert drawn["peak KV held (in use or cached)"] == [999 * 2**20 / 2**30, 800 * 2**20 / 2**30]
    assert all(p <= pool for p, pool in zip(drawn["peak KV held (in use or cached)"], drawn["KV pool"]))


def test_memory_axis_is_ticked_at_the_swept_sizes():
    sweep = [report(d, 0.1, g) for d in (1, 2) for g in (10, 20, 40, 80)]
    capacity = build_figure([report(1, 0.2, 40), report(2, 0.2, 40)], sweep, "t").axes[2]
    assert list(capacity.get_xticks()) == [10, 20, 40, 80]
    assert [t.get_text() for t in capacity.get_xticklabels()] == ["10", "20", "40", "80"]
    assert list(capacity.get_xticks(minor=True)) == []  # no 2^4, 2^5 powers-of-two labels beside them


def test_every_legend_sits_outside_its_panel():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    sweep = [report(d, 0.1, g) for d in (1, 2) for g in (10, 20)]
    fig = build_figure([report(1, 0.2, 20), report(2, 0.2, 20)], sweep, "t")
    FigureCanvasAgg(fig).draw()
    panels = fig.axes[:3]
    assert all(ax.get_legend() is not None for ax in panels)
    for ax in panels:
        legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert not legend.overlaps(frame), ax.get_title()
        assert legend.y1 <= frame.y0  # under the panel
    assert fig.axes[3].get_legend() is None  # the tables' entry is in the memory panel's legend
    assert "block tables (right axis)" in [t.get_text() for t in fig.axes[1].get_legend().get_texts()]


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_plot_file_from_the_cli(capsys, tmp_path):
    out = tmp_path / "plan.png"
    code = main(["plan", "--limit", "15", "--dcp", "1,2", "--memory-sweep", "10", "--plot", str(out), "--no-progress", "--jobs", "1"])
    assert code == 0, capsys.readouterr().err
    width, height = png_size(out)
    assert width > 1000 and height > 300  # three panels side by side
    assert sorted(os.listdir(tmp_path)) == ["plan.png"]


def test_failed_save_leaves_nothing(capsys, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def broken(self, f, **kw):
        f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", broken)
    out = tmp_path / "plan.png"
    code = main(["plan", "--limit", "5", "--dcp", "1", "--plot", str(out), "--no-progress", "--jobs", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"kvproof plan: error: cannot write plot file '{out}': No space left on device"
    assert os.listdir(tmp_path) == []


def test_an_old_plot_survives_a_failed_run(capsys, tmp_path):
    out = tmp_path / "plan.png"
    out.write_bytes(b"old")
    assert main(["plan", "--limit", "5", "--kv-memory-gib", "0.001", "--plot", str(out), "--no-progress"]) == 2
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["plan.png"]


def test_missing_matplotlib_is_one_line(capsys, monkeypatch):
    # A None entry in sys.modules makes every import of it fail, as if it were not installed (this
    # module has imported matplotlib already, and extras.require imports with importlib, so
    # patching builtins.__import__ would hide nothing and the whole default plan would run).
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plan", "--plot", "x.png", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"kvproof plan: error: {message('plot', '--plot')}\n"


def test_sweep_draws_one_line_per_dcp_and_eviction_policy():
    import dataclasses

    def both(r):
        return [r, dataclasses.replace(r, eviction="compute", cached_tokens=r.cached_tokens + 10)]

    reports = both(report(1, 0.2)) + both(report(2, 0.15))
    sweep = both(report(1, 0.1, 0.5)) + both(report(1, 0.2)) + both(report(2, 0.12, 0.5)) + both(report(2, 0.15))
    hit, _, capacity, _ = build_figure(reports, sweep, "title").axes
    assert series(hit)["hit rate (lru eviction)"] == [20.0, 15.0]
    assert series(hit)["hit rate (compute eviction)"] == [21.0, 16.0]
    assert series(capacity) == {"DCP 1, lru": [10.0, 20.0], "DCP 1, compute": [11.0, 21.0],
                                "DCP 2, lru": [12.0, 15.0], "DCP 2, compute": [13.0, 16.0]}


def test_the_slow_render_runs_before_any_file_exists(tmp_path, monkeypatch):
    """A SIGKILL while the PNG is rendered (the seconds a plot takes) leaves nothing: the file
    appears only to be written from memory and renamed."""
    from matplotlib.figure import Figure

    seen, savefig = [], Figure.savefig

    def watched(self, f, **kw):
        seen.append(sorted(os.listdir(tmp_path)))
        return savefig(self, f, **kw)

    monkeypatch.setattr(Figure, "savefig", watched)
    save_plot(str(tmp_path / "plan.png"), [report(1, 0.2), report(2, 0.1)], [], "t")
    assert seen == [[]] and os.listdir(tmp_path) == ["plan.png"]


def test_a_temporary_file_a_killed_run_left_is_removed_by_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "from kvproof.leftovers import owner_tag; print(owner_tag())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = tmp_path / f"{TEMP_PREFIX}{dead}-abcd1234.png"
    busy = tmp_path / f"{TEMP_PREFIX}{leftovers.owner_tag()}-efgh5678.png"  # a live run's, mid-write
    other = tmp_path / f"{TEMP_PREFIX}not-a-tag.png"
    for path in (left, busy, other):
        path.write_bytes(b"\x89PNG half")
    save_plot(str(tmp_path / "plan.png"), [report(1, 0.2)], [], "t")
    assert sorted(os.listdir(tmp_path)) == sorted([busy.name, other.name, "plan.png"])
