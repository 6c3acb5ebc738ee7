"""CrossHair's output becomes a verdict only after its reported calls are replayed here.

The lines below are CrossHair's own output format. The first two are the false refutations
`kvproof prove --budget 300` once printed (a RecursionError inside CrossHair's symbolic run,
and a call that meets every postcondition): they must come back ``error``, never ``refuted``.
"""

from __future__ import annotations

import inspect

from kvproof.proofs.crosshair_runs import verdict_from_output
from kvproof.proofs.registry import ERROR, PROVED, REFUTED, TIMEOUT
from kvproof.spec import geometry, placement

PLACEMENT = inspect.getsourcefile(placement)
GEOMETRY = inspect.getsourcefile(geometry)
TARGETS = "kvproof.proofs.crosshair_targets"


def _line_of(fn, text):
    source, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(source) if text in line)


def test_a_recursion_error_inside_crosshair_is_a_tool_error_not_a_counterexample():
    out = (
        f"{PLACEMENT}:87: error: RecursionError: maximum recursion depth exceeded when calling "
        "local_seq_lens(21, 5, 3)\n"
    )
    outcome = verdict_from_output((f"{TARGETS}.local_seq_lens",), out, "", 1, 60)
    assert outcome.verdict == ERROR, outcome
    assert "RecursionError" in outcome.detail and "local_seq_lens(21, 5, 3)" in outcome.detail


def test_a_call_that_meets_its_postconditions_is_a_tool_error():
    line = _line_of(geometry.block_table_width, "INV-TABLE-PAD")
    out = f"{GEOMETRY}:{line}: error: false when calling block_table_width(0, 26, 15) (which returns 0)\n"
    outcome = verdict_from_output(("kvproof.spec.geometry.block_table_width",), out, "", 1, 60)
    assert outcome.verdict == ERROR, outcome
    assert "the replay returns 0 and meets the condition" in outcome.detail


def test_a_call_that_breaks_the_named_condition_is_refuted_with_the_replay():
    out = (
        f"/x/proofs/crosshair_targets.py:40: error: \"def _width_covers_demand(group: CacheGroup, dcp: int, "
        "max_len: int, result: int) -> bool:\" yields false when calling _old_max_num_blocks_per_req(CacheGroup("
        "GroupKind.MAMBA, 1, dcp_sharded=None, mamba_cache_mode=MambaCacheMode.ALIGN, num_speculative_blocks=1, "
        "sliding_window=None), 4, 4) (which returns 2)\n"
    )
    outcome = verdict_from_output((f"{TARGETS}.old_max_num_blocks_per_req",), out, "", 1, 60)
    assert outcome.verdict == REFUTED, outcome
    assert "(which returns 2): breaks INV-TABLE-WIDTH" in outcome.counterexample


def test_a_call_outside_the_preconditions_is_a_tool_error():
    line = _line_of(placement.owner_rank, "INV-DCP-OWNER-RANGE")
    out = f"{PLACEMENT}:{line}: error: false when calling owner_rank(-1, 2, 1) (which returns 1)\n"
    outcome = verdict_from_output(("kvproof.spec.placement.owner_rank",), out, "", 1, 60)
    assert outcome.verdict == ERROR and "breaks a precondition" in outcome.detail, outcome


def test_not_confirmed_is_a_timeout_and_all_confirmed_is_proved():
    confirmed = f"{PLACEMENT}:30: info: Confirmed over all paths.\n"
    open_ = f"{PLACEMENT}:48: info: Not confirmed.\n"
    assert verdict_from_output(("t",), confirmed, "", 0, 60).verdict == PROVED
    outcome = verdict_from_output(("t",), confirmed + open_, "", 0, 60)
    assert outcome.verdict == TIMEOUT and "placement.py:48" in outcome.detail


def test_no_output_is_an_error_naming_stderr():
    outcome = verdict_from_output(("t",), "", "Traceback ...\nImportError: no module t\n", 1, 60)
    assert outcome.verdict == ERROR and "ImportError: no module t" in outcome.detail
