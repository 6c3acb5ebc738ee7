"""CrossHair over the spec's icontract contracts (``crosshair check --analysis_kind=icontract``).

CrossHair executes the spec symbolically: ``@require`` are assumptions, ``@ensure`` are
obligations. Per condition it answers "confirmed over all paths" (every path explored: a
proof for Python's semantics -> ``proved``), "not confirmed" (budget spent, nothing found ->
``unrefuted``) or an error with the calling arguments (-> ``refuted``). Each obligation runs
one ``crosshair`` process over its targets with a per-condition timeout sized from the budget.
"""

from __future__ import annotations

import re
import subprocess
import sys

from kvproof.proofs.registry import ERROR, PROVED, REFUTED, UNREFUTED, Obligation, Outcome

_LINE = re.compile(r"^(?P<path>[^:\n]+):(?P<line>\d+): (?P<level>error|info): (?P<message>.*)$")
#: CrossHair measures its timeouts in CPU seconds; give each condition at least this many.
MIN_PER_CONDITION = 1.0


def run_crosshair(targets: tuple[str, ...], conditions: int, budget: float, fixed: float | None = None) -> Outcome:
    """Check ``targets`` (importable names); ``conditions`` is how many contracts they carry,
    to split the budget. ``fixed``: a per-condition timeout that ignores the budget."""
    # CrossHair overshoots its CPU-second timeouts in wall time (start-up, path wrap-up): aim low.
    per_condition = fixed or max(MIN_PER_CONDITION, 0.75 * budget / max(conditions, 1))
    cmd = [
        sys.executable, "-m", "crosshair", "check", "--analysis_kind=icontract", "--report_all",
        f"--per_condition_timeout={per_condition:.1f}", *targets,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget + 60)
    except subprocess.TimeoutExpired:
        return Outcome(UNREFUTED, detail="crosshair ran past its budget")
    results = [m for m in map(_LINE.match, proc.stdout.splitlines()) if m]
    errors = [m["message"] for m in results if m["level"] == "error"]
    if errors:
        return Outcome(REFUTED, counterexample="; ".join(_short(e) for e in errors))
    if proc.returncode != 0 or not results:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Outcome(ERROR, detail=f"crosshair exited {proc.returncode}: {tail}")
    confirmed = sum(1 for m in results if m["message"].startswith("Confirmed over all paths"))
    verdict = PROVED if confirmed == len(results) else UNREFUTED
    return Outcome(verdict, detail=f"{confirmed} of {len(results)} conditions confirmed over all paths, "
                   f"{per_condition:.1f}s each")


def _short(message: str) -> str:
    """From 'when calling f(...)' on: the arguments are the counterexample."""
    i = message.find("when calling ")
    return message[i:] if i >= 0 else message


def crosshair_obligation(id: str, invariants: tuple[str, ...], statement: str, targets: tuple[str, ...],
                         conditions: int, weight: float, fixed: float | None = None) -> Obligation:
    return Obligation(
        id, invariants, "crosshair", statement,
        lambda budget: run_crosshair(targets, conditions, budget, fixed), weight,
    )


_T = "kvproof.proofs.crosshair_targets."

OBLIGATIONS = (
    crosshair_obligation(
        "CH-ARITH", ("INV-ARITH-CDIV", "INV-ARITH-FLOOR"),
        "cdiv and floor_to meet their postconditions", ("kvproof.spec.arith",), conditions=2, weight=1.0,
    ),
    crosshair_obligation(
        "CH-PLACEMENT",
        ("INV-DCP-OWNER-RANGE", "INV-DCP-LOCAL-IN-BLOCK", "INV-DCP-LOCAL-LEN-BOUND", "INV-DCP-LOCAL-LEN-SUM",
         "INV-DCP-LOCAL-LEN-BALANCE", "INV-SLOT-TABLE-INDEX", "INV-DCP-OWNER-UNIQUE"),
        "owner_rank, local_position, local_seq_len(s), table_index and owning_ranks meet their postconditions",
        (
            "kvproof.spec.placement.owner_rank", "kvproof.spec.placement.local_position",
            "kvproof.spec.placement.local_seq_len", _T + "local_seq_lens", _T + "table_index", _T + "owning_ranks",
        ),
        conditions=8, weight=6.0,
    ),
    crosshair_obligation(
        "CH-GEOMETRY",
        ("INV-GEOM-EFFECTIVE-BLOCK", "INV-GEOM-MAMBA-REPLICATED", "INV-TABLE-WIDTH", "INV-TABLE-PAD"),
        "effective_block_size, max_num_blocks_per_req and block_table_width meet their postconditions",
        (_T + "effective_block_size", _T + "max_num_blocks_per_req", _T + "block_table_width"),
        conditions=4, weight=3.0,
    ),
    crosshair_obligation(
        "CANARY-CH-MAMBA-WIDTH", ("INV-TABLE-WIDTH",),
        "CrossHair finds the old Mamba width rule (divided by DCP) against max_num_blocks_per_req's contract",
        # A fixed timeout: CrossHair's per-path timeout grows with it and changes which
        # counterexample it meets first; the golden file pins the one found at 4 s.
        (_T + "old_max_num_blocks_per_req",), conditions=1, weight=0.5, fixed=4.0,
    ),
)
