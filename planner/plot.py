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
    'hit rate vs KV memory' (one line per DCP size and eviction policy). No state change
    outside matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    panels = 3 if sweep else 2
    fig = Figure(figsize=(5.2 * panels, 4.2), layout="constrained")
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
    ax.set_xscale("log", base=2)
    ax.set_xticks(dcps, [str(d) for d in dcps])
    ax.set_xlabel("DCP size")
    ax.set_ylabel("prompt tokens from the prefix cache (%)")
    ax.set_title("hit rate vs DCP size")
    ax.set_ylim(bottom=0)
    ax.legend()

    ax = axes[1]
    ax.plot(dcps, [gib(r.num_blocks * r.block_bytes) for r in runs], "o-", label="KV pool")
    if all(r.peak_blocks_per_group is not None for r in runs):
        ax.plot(dcps, [gib(sum(r.peak_blocks_per_group or ()) * r.block_bytes) for r in runs], "^-", label="peak KV in use")
    ax.plot(dcps, [gib(sum(r.table_bytes_per_group)) for r in runs], "s--", label="block tables")
    ax.set_xscale("log", base=2)
    ax.set_xticks(dcps, [str(d) for d in dcps])
    ax.set_xlabel("DCP size")
    ax.set_ylabel("GiB per GPU")
    ax.set_title("memory vs DCP size")
    ax.set_ylim(bottom=0)
    ax.legend()

    if sweep:
        ax = axes[2]
        styles = ("o-", "s--", "^:", "d-.")
        for i, dcp in enumerate(sorted({r.dcp for r in sweep})):
            for j, policy in enumerate(policies):
                points = sorted((r for r in sweep if r.dcp == dcp and r.eviction == policy), key=lambda r: r.kv_memory_bytes or 0)
                ax.plot([gib(r.kv_memory_bytes or 0) for r in points], [100 * r.hit_rate for r in points], styles[j % len(styles)],
                        color=f"C{i}", label=f"DCP {dcp}" + (f", {policy}" if several else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV memory per GPU (GiB)")
        ax.set_ylabel("prompt tokens from the prefix cache (%)")
        ax.set_title("hit rate vs KV memory")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(title, fontsize="medium")
    return fig


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
