"""The lazy replay: requests built on arrival and dropped when finished, idle steps skipped, a
streamed trace consumed once and in order, the step limit an input error."""

from __future__ import annotations

import gc

import pytest

from kvproof.impl.request import Request
from kvproof.sim.replay import StepLimitError, replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def layout(max_len: int = 4096):
    return resolve_layout(LayoutConfig((CacheGroup(FA, 4), CacheGroup(MAMBA, 8)), max_model_len=max_len))


def shared(i: int, arrival: int, n_out: int = 3) -> TraceRequest:
    return TraceRequest(f"r{i}", tuple(range(40)) + (1000 + i,), tuple(range(5000 + 10 * i, 5000 + 10 * i + n_out)), arrival)


def test_idle_steps_are_skipped_to_the_next_arrival():
    trace = [shared(0, 0), shared(1, 2_000_000)]
    result = replay(trace, layout(), 64, max_num_batched_tokens=64)
    assert result.violations == []
    assert result.steps == 2_000_000 + 2  # the clock: prefill at the arrival step, then two decodes
    assert result.steps_run == 7  # r0: chunks 40 + 1 (Mamba block end), two decodes; r1: 1 + two decodes
    assert [r.num_cached_tokens for r in result.requests] == [0, 40]


def test_a_streamed_trace_is_pulled_only_as_requests_arrive():
    arrivals = [0, 0, 5, 9, 30, 31, 200]
    pulled: list[int] = []

    def stream():
        for i, a in enumerate(arrivals):
            pulled.append(a)
            yield shared(i, a)

    seen: list[tuple[int, int]] = []
    result = replay(stream(), layout(), 256, max_num_batched_tokens=64, on_step=lambda plan, s: seen.append((plan.step, len(pulled))))
    assert result.violations == [] and result.num_requests == len(arrivals)
    for step, n_pulled in seen:
        arrived_by_next_step = sum(1 for a in arrivals if a <= step)
        assert n_pulled <= arrived_by_next_step + 1, (step, n_pulled)  # one request of lookahead at most


def test_only_requests_in_flight_are_alive():
    def live_requests() -> int:
        return sum(1 for o in gc.get_objects() if isinstance(o, Request))

    gc.collect()
    before = live_requests()
    worst = []

    def on_step(plan, sched):
        in_flight = len(sched.pending) + len(sched.waiting) + len(sched.running)
        worst.append(live_requests() - before - in_flight)

    result = replay([shared(i, 3 * i) for i in range(8)], layout(), 256, max_num_batched_tokens=64, on_step=on_step)
    gc.collect()
    assert result.num_requests == 8 and len(result.requests) == 8
    assert max(worst) <= 1  # finished ones are gone; at most the request finishing this step
    assert live_requests() == before


def test_keep_requests_false_keeps_only_totals():
    trace = [shared(i, 2 * i) for i in range(5)]
    full = replay(trace, layout(), 256, max_num_batched_tokens=64)
    lean = replay(iter(trace), layout(), 256, max_num_batched_tokens=64, keep_requests=False)
    assert lean.requests == []
    assert (lean.prompt_tokens, lean.cached_tokens, lean.requests_with_hit) == (
        sum(r.num_prompt_tokens for r in full.requests),
        sum(r.num_cached_tokens for r in full.requests),
        sum(1 for r in full.requests if r.num_cached_tokens),
    )
    assert lean.prefill_tokens == lean.prompt_tokens - lean.cached_tokens  # no preemption here


def test_a_list_in_any_order_replays_by_arrival_and_reports_in_trace_order():
    trace = [shared(0, 50), shared(1, 0)]
    result = replay(trace, layout(), 256, max_num_batched_tokens=64)
    assert [r.request_id for r in result.requests] == ["r0", "r1"]
    assert [r.num_cached_tokens for r in result.requests] == [40, 0]  # r1 ran first


def test_a_stream_out_of_arrival_order_is_refused():
    with pytest.raises(ValueError, match="'r1' arrives at step 0, before the preceding request 'r0' \\(step 50\\)"):
        replay(iter([shared(0, 50), shared(1, 0)]), layout(), 256)


def test_a_request_id_in_flight_twice_is_refused():
    with pytest.raises(ValueError, match="request id 'r0' is already in flight"):
        replay(iter([shared(0, 0), shared(0, 0)]), layout(), 256)


def test_a_million_output_steps_are_not_a_violation_but_a_step_limit_is_an_input_error():
    long = TraceRequest("long", tuple(range(9)), tuple(range(100, 100 + 2_000)))
    assert replay([long], layout(), 1024).violations == []
    with pytest.raises(StepLimitError, match="step limit of 500 steps"):
        replay([long], layout(), 1024, max_steps=500)
