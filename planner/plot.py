"""The plan as a picture: hit rate and memory against DCP size, and (with a memory sweep) hit
rate against KV memory per GPU for each DCP size -- capacity against hit rate, the shape of the
Mooncake paper's Fig. 9. Needs matplotlib (the ``plot`` extra); the file appears whole or not
at all."""

from __future__ import annotations

import io
import os

from kvproof import leftovers
from kvproof.extras import require
from kvproof.planner.memory import gib
from kvproof.planner.run import ConfigReport


def require_matplotlib() -> None:
    """Raise ``kvproof.extras.MissingExtra`` (one line naming the ``plot`` extra and its install
    command) when matplotlib does not import."""
    require("plot", "--plot")


def check_destination(path: str) -> None:
    """Raise ValueError if ``path`` cannot be written (checked before any replay work)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path.lower().endswith(".png"):
        raise ValueError(f"plot file {path!r} must end in .png")
    if os.path.isdir(path):
        raise ValueError(f"plot file {path!r} is a directory")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write plot file {path!r}: folder {folder!r} is missing or not writable")


def build_figure(reports: list[ConfigReport], sweep: list[ConfigReport], title: str, vllm_reports: list[ConfigReport] = ()):
    """The figure (not saved): axes 'hit rate vs DCP', 'memory vs DCP' and, with a sweep,
    'hit rate vs KV memory' (one line per DCP size and eviction policy), then the memory
    panel's right axis (block tables, in MiB) last in ``fig.axes``. Legends sit under their
    panels. No state change outside matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    panels = 3 if sweep else 2
    fig = Figure(figsize=(5.2 * panels, 5.0), layout="constrained")
    axes = fig.subplots(1, panels)
    policies = list(dict.fromkeys(r.eviction for r in reports))
    several = len(policies) > 1
    runs = sorted((r for r in reports if r.eviction == policies[0]), key=lambda r: r.dcp)
    dcps = [r.dcp for r in runs]

    ax = axes[0]
    for policy in policies:
        mine = sorted((r for r in reports if r.eviction == policy), key=lambda r: r.dcp)
        suffix = f" ({policy} eviction)" if several else ""
        ax.plot([r.dcp for r in mine], [100 * r.hit_rate for r in mine], "o-" if policy == policies[0] else "o:", label="hit rate" + suffix)
    ax.plot(dcps, [100 * (r.attention_hit_rate or 0.0) for r in runs], "s--", label="attention groups alone")
    if vllm_reports:
        theirs = sorted(vllm_reports, key=lambda r: r.dcp)
        ax.plot([r.dcp for r in theirs], [100 * r.hit_rate for r in theirs], "x:", label="vLLM 0.33.0")
    _dcp_axis(ax, dcps)
    ax.set_ylabel("prompt tokens from the prefix cache (%)")
    ax.set_title("hit rate vs DCP size")
    ax.set_ylim(bottom=0)
    _legend_below(ax)

    ax = axes[1]
    ax.plot(dcps, [gib(r.num_blocks * r.block_bytes) for r in runs], "o-", label="KV pool")
    if all(r.peak_blocks is not None for r in runs):  # all groups at once: never above the pool
        ax.plot(dcps, [gib(r.peak_blocks * r.block_bytes) for r in runs], "^-", label="peak KV held (in use or cached)")
    _dcp_axis(ax, dcps)
    ax.set_ylabel("GiB per GPU")
    ax.set_title("memory vs DCP size")
    ax.set_ylim(0, 1.15 * max(gib(r.num_blocks * r.block_bytes) for r in runs))  # the pool line clear of the frame
    # The block tables are MiB beside a pool of GiB: on the pool's axis they would sit at 0.
    tables = ax.twinx()
    table_mib = [sum(r.table_bytes_per_group) / 2**20 for r in runs]
    tables.plot(dcps, table_mib, "s--", color="C2", label="block tables (right axis)")
    tables.set_ylabel("block tables, MiB per GPU")
    tables.set_ylim(0, 1.15 * max(table_mib) or 1)
    _legend_below(ax, tables)

    if sweep:
        ax = axes[2]
        styles = ("o-", "s--", "^:", "d-.")
        for i, dcp in enumerate(sorted({r.dcp for r in sweep})):
            for j, policy in enumerate(policies):
                points = sorted((r for r in sweep if r.dcp == dcp and r.eviction == policy), key=lambda r: r.kv_memory_bytes or 0)
                ax.plot([gib(r.kv_memory_bytes or 0) for r in points], [100 * r.hit_rate for r in points], styles[j % len(styles)],
                        color=f"C{i}", label=f"DCP {dcp}" + (f", {policy}" if several else ""))
        sizes = sorted({gib(r.kv_memory_bytes) for r in sweep if r.kv_memory_bytes is not None})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s:.3g}" for s in sizes])  # the swept sizes, not powers of two
        ax.xaxis.set_minor_locator(_null_locator())
        ax.set_xlabel("KV memory per GPU (GiB)")
        ax.set_ylabel("prompt tokens from the prefix cache (%)")
        ax.set_title("hit rate vs KV memory")
        ax.set_ylim(bottom=0)
        _legend_below(ax)
    fig.suptitle(title, fontsize="medium")
    return fig


def _dcp_axis(ax, dcps: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(dcps, [str(d) for d in dcps])
    ax.xaxis.set_minor_locator(_null_locator())
    ax.set_xlabel("DCP size")


def _legend_below(ax, *more) -> None:
    """The legend under the axes, outside them, so it never covers a curve."""
    handles, labels = [], []
    for a in (ax, *more):
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize="small",
              frameon=False)


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


#: The temporary file beside the plot: ``.kvproof-plot-<owner>-XXXXXXXX.png`` (kvproof.leftovers).
TEMP_PREFIX = ".kvproof-plot-"


def save_plot(path: str, reports: list[ConfigReport], sweep: list[ConfigReport], title: str, vllm_reports: list[ConfigReport] = ()) -> None:
    """Write the PNG atomically: rendered in memory, written into a temporary file beside
    ``path``, then renamed over it, so a reader never sees a half-written plot and a failure
    leaves nothing behind. A temporary file that a killed run left in that folder (it names its
    owner) is removed first."""
    fig = build_figure(reports, sweep, title, vllm_reports)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)  # the slow part, before any file exists
    folder = os.path.dirname(os.path.abspath(path))
    leftovers.remove_stale(folder, TEMP_PREFIX)
    fd, tmp = leftovers.make_temp_file(TEMP_PREFIX, ".png", folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(png.getbuffer())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
