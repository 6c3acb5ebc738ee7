"""The hybrid coordinator through the KV-cache-manager facade: vLLM's partial-hit scenarios
(docs/vllm-semantics.md §9.1, with kvproof's semantics where 0.33.0 is wrong) and each contract
firing."""

from __future__ import annotations

import pytest

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.sim import drive
from kvproof.sim.drive import Step, run_chunk
from kvproof.spec.arith import cdiv
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA, SWA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA, GroupKind.SLIDING_WINDOW


def make_kv(groups, dcp=1, hash_block_size=None, num_blocks=64, eagle=False, partial=True, retention=None):
    """Dense retention unless asked (these scenarios key every chunk end, as docs/vllm-semantics.md
    §9.1's one-shot producers assume); retention 0 has scenarios of its own below."""
    layout = resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=4096, hash_block_size=hash_block_size,
                                         allow_partial_hash_hits=partial, retention_interval=retention))
    return KVCacheManager(layout, num_blocks, use_eagle=eagle)


def with_row_width(layout, group_index, width):
    """``layout`` with one group's row sized wrongly (as by vLLM's old DCP-divided rule)."""
    import dataclasses

    groups = list(layout.groups)
    groups[group_index] = dataclasses.replace(groups[group_index], max_num_blocks_per_req=width, table_width=width)
    return dataclasses.replace(layout, groups=tuple(groups))


def run_chunks(kv, req, chunks):
    """Schedule ``req`` alone for each chunk size in turn (lookup on its first); every chunk fits."""
    assert all(run.blocks is not None for run in drive.run_chunks(kv, req, chunks))


def req(rid, tokens, kv, salt=None):
    return Request(rid, tokens, kv.layout.hash_block_size, cache_salt=salt)


# --- docs/vllm-semantics.md §9.1: partial hits under DCP ------------------------------------------

@pytest.mark.parametrize("dcp", [1, 2])
def test_k3_prime_then_replay_hits_256(dcp):
    kv = make_kv([CacheGroup(FA, 256), CacheGroup(MAMBA, 256)], dcp=dcp, num_blocks=32)
    shared = list(range(1000, 1256))
    prime = req("prime", shared + [7], kv)
    run_chunks(kv, prime, [256, 1])
    kv.free(prime)
    replay = req("replay", shared + [8, 9], kv)
    hit, _, copies = run_chunk(kv, replay, 2)
    assert hit.num_tokens == 256
    # Under DCP 2 the attention virtual block is 512 tokens: 256 is half of it -> one FA copy.
    assert [g for g, _, _ in copies] == ([0] if dcp == 2 else [])


def test_k3_old_rule_under_dcp_2_gives_no_hit():
    kv = make_kv([CacheGroup(FA, 256), CacheGroup(MAMBA, 256)], dcp=2, num_blocks=32, partial=False)
    shared = list(range(256))
    prime = req("prime", shared + [7], kv)
    run_chunks(kv, prime, [256, 1])
    kv.free(prime)
    hit, _, _ = run_chunk(kv, req("replay", shared + [8, 9], kv), 2)
    assert hit.num_tokens == 0


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_partial_hash_hit_copies_both_groups(dcp):
    """FA 4 (B = 4*dcp), Mamba 4, H 2: a 6-token producer, an 8-token replay hits 6 with a copy
    in both groups (6 is inside an attention block and inside a Mamba block)."""
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], dcp=dcp, hash_block_size=2)
    run_chunks(kv, req("p", [1, 2, 3, 4, 5, 6], kv), [6])
    r = req("r", [1, 2, 3, 4, 5, 6, 7, 8], kv)
    hit, blocks, copies = run_chunk(kv, r, 2)
    assert hit.num_tokens == 6
    assert [len(b) for b in hit.blocks] == [cdiv(6, 4 * dcp), 2]
    assert sorted(g for g, _, _ in copies) == [0, 1]
    assert all(src != dst for _, src, dst in copies)


def test_dcp_fine_hit_on_hash_boundary():
    """D 4, FA 2 (B = 8), Mamba 2, H 2: a producer computes 6 of 7 tokens; the same prompt hits 6."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 2)], dcp=4)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    run_chunks(kv, req("p", prompt, kv), [6])
    hit, _, _ = run_chunk(kv, req("c", prompt, kv), 1)
    assert hit.num_tokens == 6


def test_joint_hit_is_bounded_by_mamba_states():
    """D 2, block 4 = H: with states at 8 and 12 only after the producer computed 12."""
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], dcp=2)
    prompt = list(range(12))
    producer = req("p", prompt, kv)
    run_chunks(kv, producer, [8])
    hit, _, _ = run_chunk(kv, req("a", prompt + [99, 98, 97, 96], kv), 1)
    assert hit.num_tokens == 8
    assert [len(b) for b in hit.blocks] == [1, 2]
    # A fresh manager keeps the second half independent of the consumer above.
    kv2 = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], dcp=2)
    run_chunks(kv2, req("p", prompt, kv2), [8, 4])
    hit, _, _ = run_chunk(kv2, req("b", prompt + [99, 98, 97, 96], kv2), 1)
    assert hit.num_tokens == 12
    assert [len(b) for b in hit.blocks] == [2, 3]


def test_eagle_drops_one_hash_unit():
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], dcp=2, hash_block_size=2, eagle=True)
    run_chunks(kv, req("p", [7] * 6, kv), [4, 2])
    hit, blocks, _ = run_chunk(kv, req("r", [7] * 8, kv), 4)
    assert hit.num_tokens == 4
    assert blocks is not None and all(len(b) * bs >= 4 for b, bs in zip(hit.blocks, (8, 4)))


def test_sliding_window_forces_block_aligned_hits(caplog):
    """FA 2 / Mamba 8 plus a replicated window group of 4: partial hits off, with a warning
    naming the window group; hits at S = 8."""
    with caplog.at_level("WARNING", logger="kvproof"):
        kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 8), CacheGroup(SWA, 4, sliding_window=8)])
    assert any("falling back to block-aligned" in r.message and "sliding_window:4" in r.message for r in caplog.records)
    assert not kv.layout.partial_hash_hits and kv.layout.cache_hit_alignment == 8
    prompt = list(range(12))
    run_chunks(kv, req("p", prompt, kv), [8, 4])
    hit, _, _ = run_chunk(kv, req("r", prompt + [1], kv), 5)
    assert hit.num_tokens == 8
    assert len(hit.blocks[0]) * 2 == 8


def test_running_owner_copies_its_cached_state_before_writing_in_place():
    """A 7-token prompt in chunks 6 + 1 (Mamba 4, H 2): the state at 6 is cached; continuing
    writes block 1 in place, so the owner first copies it and the key moves to the copy; a later
    request hits the moved state (and copies it again)."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    prompt = [3, 1, 4, 1, 5, 9, 2]
    owner = req("o", prompt, kv)
    run_chunks(kv, owner, [6])
    state = kv.block_table(owner)[1][1]
    key_before = kv.pool.key_of(state)
    assert key_before is not None
    with Step(kv) as step:
        appended = step.schedule(owner, 1).blocks
        assert len(appended[0]) == 1 and appended[1] == []  # no new Mamba entry: the row is append-only
    assert step.copies and step.copies[0][:2] == (1, state)
    moved = step.copies[0][2]
    assert kv.pool.key_of(state) is None and kv.pool.key_of(moved) == key_before
    hit, _, copies = run_chunk(kv, req("later", prompt[:6] + [8, 8], kv), 2)
    assert hit.num_tokens == 6 and hit.blocks[1][-1] == moved
    assert (1, moved) in [(g, s) for g, s, _ in copies]


def first_chunk(kv, request, num_new):
    """Admit ``request`` on its hit with a first chunk of ``num_new`` tokens, in a new step (its
    copies taken: they ran), and leave the step open."""
    kv.begin_step()
    assert kv.allocate_slots(request, num_new, kv.lookup(request)) is not None
    kv.take_block_copies()


def lagging_step(kv, request, written, allocated, num_new):
    """One step as vLLM's Scheduler drives kvproof's manager with async scheduling: the step
    before it has not returned, so only ``written`` tokens are keyed at its start; then
    ``num_new`` tokens are allocated after the ``allocated`` ones. Returns the step's copies."""
    request.num_computed_tokens = written
    kv.cache(request)
    kv.begin_step()
    request.num_computed_tokens = allocated
    assert kv.allocate_slots(request, num_new) is not None
    return kv.take_block_copies()


def test_under_async_scheduling_a_state_the_next_step_overwrites_is_keyed_on_its_copy():
    """The 7-token prompt of the test above, chunks 6 + 1, but the second chunk is allocated
    before the first has returned (async scheduling): the state at 6 is not keyed yet and the
    second chunk writes its block in place, so it copies the state out first (its copies run
    after the first chunk's forward pass), and once the first chunk returns the key goes to the
    copy, never to the block being overwritten. A later request hits the copy."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    prompt = [3, 1, 4, 1, 5, 9, 2]
    owner = req("o", prompt, kv)
    first_chunk(kv, owner, 6)
    copies = lagging_step(kv, owner, written=0, allocated=6, num_new=1)
    state = kv.block_table(owner)[1][1]
    assert [(g, src) for g, src, _ in copies] == [(1, state)] and kv.pool.key_of(state) is None
    copy = copies[0][2]
    owner.num_computed_tokens = 6  # the first chunk returned: its state is keyed, on the copy
    kv.cache(owner)
    assert kv.pool.key_of(state) is None and kv.pool.num_tokens_of(copy) == 6
    owner.num_computed_tokens = 7
    kv.cache(owner)
    kv.check_state()
    hit, _, _ = run_chunk(kv, req("later", prompt[:6] + [8, 8], kv), 2)
    assert hit.num_tokens == 6 and hit.blocks[1][-1] == copy


def test_under_async_scheduling_a_state_left_behind_is_keyed_on_its_own_block():
    """Chunks 4 + 4 of a 9-token prompt (Mamba 4): the second chunk moves the state to a new
    block, so the state at 4 needs no copy and is keyed where the first chunk left it once that
    returns; the row holds it until the second chunk, which reads it, has returned too."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    owner = req("o", list(range(9)), kv)
    first_chunk(kv, owner, 4)
    assert lagging_step(kv, owner, written=0, allocated=4, num_new=4) == []
    first = kv.block_table(owner)[1][0]
    owner.num_computed_tokens = 4
    kv.cache(owner)
    assert kv.pool.num_tokens_of(first) == 4 and kv.block_table(owner)[1][0] == first
    kv.check_state()
    owner.num_computed_tokens = 8
    kv.cache(owner)
    assert kv.block_table(owner)[1][0] == 0  # released once the step reading it returned


def test_under_async_scheduling_decode_keys_the_states_it_ends_on_through_idle_steps():
    """Decode one token a step, each step allocated before the previous one returned (Mamba 8,
    H 4): the idle steps in between skip the managers, every state on the hash grid that a step
    ended on is keyed once that step returns (in place inside a block: on the copy the next step
    took), and the whole state stays consistent throughout."""
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 8)], hash_block_size=4)
    owner = req("o", list(range(30)), kv)
    first_chunk(kv, owner, 9)
    written, keyed = 0, {}
    for allocated in range(9, 24):
        lagging_step(kv, owner, written=written, allocated=allocated, num_new=1)
        kv.check_state()
        written = allocated
        for n in (12, 16, 20):
            found = kv.cached_block(owner.block_hashes[n // 4 - 1], 1)
            if found is not None:
                keyed.setdefault(n, written)
    assert keyed == {12: 13, 16: 17, 20: 21}  # each once the step ending on it returned, not before


def test_mamba_keeps_at_most_two_real_blocks():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", list(range(40)), kv)
    run_chunks(kv, r, [4, 4, 4, 8, 8, 12])
    assert sum(1 for b in kv.block_table(r)[1] if b) == 1


def test_cache_salt_isolates_tenants():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    run_chunks(kv, req("a", list(range(9)), kv, salt="tenant-a"), [8])
    assert run_chunk(kv, req("b", list(range(9)), kv, salt="tenant-b"), 1)[0].num_tokens == 0
    assert run_chunk(kv, req("c", list(range(9)), kv, salt="tenant-a"), 1)[0].num_tokens == 8


# --- atomicity and contracts --------------------------------------------------------------------

def test_failed_allocation_changes_nothing():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)], num_blocks=8)
    big = req("big", list(range(40)), kv)
    kv.begin_step()
    free, order = kv.pool.num_free, kv.pool.free_order()
    assert kv.allocate_slots(big, 40, kv.lookup(big)) is None
    assert kv.pool.num_free == free and kv.pool.free_order() == order
    assert kv.block_table(big) == ([], [])
    assert big.num_computed_tokens == 0


def test_table_width_checked_for_every_group_before_any_write():
    layout = with_row_width(resolve_layout(LayoutConfig((CacheGroup(FA, 2), CacheGroup(MAMBA, 4)), max_model_len=8)), 1, 1)
    kv = KVCacheManager(layout, 64)
    r = Request("r", list(range(8)), layout.hash_block_size)
    kv.begin_step()
    free = kv.pool.num_free
    with pytest.raises(InvariantViolation, match=r"INV-TABLE-WIDTH: request 'r', group 1 \(mamba:4\): 8 tokens need 2 table entries > row width 1"):
        kv.allocate_slots(r, 8)
    assert kv.pool.num_free == free and kv.block_table(r) == ([], [])


def test_cow_source_ready_fires_when_keys_are_added_before_the_forward_pass():
    """vLLM 0.33's ordering (docs/vllm-semantics.md §10.1): keys registered inside allocate, before
    the forward pass, let a same-step request copy a block the forward has not written yet."""
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], hash_block_size=2)
    producer = req("p", [1, 2, 3, 4, 5, 6, 7], kv)
    kv.begin_step()
    kv.allocate_slots(producer, 6, kv.lookup(producer))
    producer.num_computed_tokens = 6
    kv.cache(producer)  # too early: this step's forward has not run
    consumer = req("c", [1, 2, 3, 4, 5, 6, 9], kv)
    with pytest.raises(InvariantViolation, match="INV-COW-SOURCE-READY: request 'c', group 0: copy .* which was allocated this step"):
        kv.allocate_slots(consumer, 1, kv.lookup(consumer))


def test_chained_copy_is_refused():
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], hash_block_size=2)
    ledger = kv.coordinator.ledger
    kv.begin_step()
    ledger.add_copy(0, "a", 5, 6)
    with pytest.raises(InvariantViolation, match="chained copy"):
        ledger.add_copy(0, "b", 6, 7)
    with pytest.raises(InvariantViolation, match="chained copy"):
        ledger.add_copy(0, "b", 9, 5)


def test_free_of_a_request_allocated_in_the_running_step_is_refused():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", [1, 2, 3], kv)
    kv.begin_step()
    kv.allocate_slots(r, 3, kv.lookup(r))
    with pytest.raises(InvariantViolation, match="INV-STEP-PROTOCOL"):
        kv.free(r)


def test_mamba_real_block_bound_fires():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", list(range(12)), kv)
    run_chunks(kv, r, [4])
    kv.managers[1].requests["r"].row[0:0] = [kv.pool.allocate(1)[0]]  # an extra state block kept
    with pytest.raises(InvariantViolation, match="INV-MAMBA-REAL-BLOCKS"):
        kv.check_request(r)


def test_mamba_real_block_bound_is_cheap_and_catches_a_state_never_released(monkeypatch):
    """With the slow switch off: a manager that forgets to release the state it advanced past
    is caught at the very next ``cache``, naming the row index it kept."""
    from kvproof.impl.managers.mamba import MambaManager
    from kvproof.spec import contracts

    advance = MambaManager._advance

    def leaky_advance(self, state, new_index, step):
        advance(self, state, new_index, step)
        step.superseded = -1  # the bug: the old state is never released

    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", list(range(12)), kv)
    with contracts.slow_checks(False):
        run_chunks(kv, r, [4])
        monkeypatch.setattr(MambaManager, "_advance", leaky_advance)
        with pytest.raises(InvariantViolation, match=r"INV-MAMBA-REAL-BLOCKS: request 'r', group 1: 2 real state "
                                                     r"blocks between steps > 1 \(kept below the state at row index 1: \[0\]\)"):
            run_chunks(kv, r, [4])


def test_hit_bound_fires_on_a_finder_that_overshoots(monkeypatch):
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    from kvproof.impl.coordinator import Hit
    monkeypatch.setattr(kv.coordinator, "find_longest_hit", lambda request, bound: Hit(bound + 1, ([], [])))
    with pytest.raises(InvariantViolation, match="INV-HIT-BOUND"):
        kv.lookup(req("r", [1, 2, 3, 4], kv))


def test_bad_input_is_named():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", [1, 2, 3], kv)
    kv.begin_step()
    with pytest.raises(ValueError, match="num_new_tokens 0 must be an int > 0"):
        kv.allocate_slots(r, 0)
    with pytest.raises(ValueError, match="exceed the 3 known tokens"):
        kv.allocate_slots(r, 4)


def test_hit_blocks_contract_fires_on_a_short_block_list(monkeypatch):
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    run_chunks(kv, req("p", list(range(9)), kv), [8])
    fa = kv.managers[0]
    real = fa.find_hit
    monkeypatch.setattr(fa, "find_hit", lambda request, bound: (lambda h: (h[0], h[1][:-1]))(real(request, bound)))
    with pytest.raises(InvariantViolation, match="INV-HIT-BLOCKS: request 'r', group 0: hit 8 needs 4 blocks, finder returned 3"):
        kv.lookup(req("r", list(range(9)), kv))


def test_mamba_state_index_contract_fires_on_a_wrong_computed_count():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", list(range(12)), kv)
    first_chunk(kv, r, 8)
    r.num_computed_tokens = 4  # the step computed 8, the caller says 4
    with pytest.raises(InvariantViolation, match="INV-MAMBA-STATE-INDEX"):
        kv.cache(r)


def test_mamba_state_index_contract_fires_on_a_count_between_steps_with_one_in_flight():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", list(range(16)), kv)
    first_chunk(kv, r, 8)
    lagging_step(kv, r, written=0, allocated=8, num_new=4)  # steps ending at 8 and 12 allocated
    r.num_computed_tokens = 10  # neither step ended there
    with pytest.raises(InvariantViolation, match=r"INV-MAMBA-STATE-INDEX: request 'r', group 1: state after 10 tokens "
                                                 r"must be at index 2, the last step that ran ended at 8"):
        kv.cache(r)


def test_table_held_contract_fires_when_a_table_block_is_freed_behind_the_manager():
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    r = req("r", list(range(12)), kv)
    run_chunks(kv, r, [8])
    kv.pool.free([kv.block_table(r)[0][0]])
    with pytest.raises(InvariantViolation, match="INV-TABLE-HELD"):
        kv.check_state()


def test_alloc_atomic_contract_fires_when_sizing_undercounts(monkeypatch):
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)], num_blocks=6)
    monkeypatch.setattr(kv.managers[0], "blocks_needed", lambda *a: 0)
    r = req("r", list(range(12)), kv)
    kv.begin_step()
    with pytest.raises(InvariantViolation, match="INV-ALLOC-ATOMIC"):
        kv.allocate_slots(r, 12, kv.lookup(r))


def test_step_protocol_fires_when_copies_are_never_taken():
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], hash_block_size=2)
    run_chunks(kv, req("p", [1, 2, 3, 4, 5, 6], kv), [6])
    r = req("r", [1, 2, 3, 4, 5, 6, 7, 8], kv)
    kv.begin_step()
    kv.allocate_slots(r, 2, kv.lookup(r))  # a partial hit: copies are queued
    r.num_computed_tokens = 8
    kv.cache(r)
    with pytest.raises(InvariantViolation, match="INV-STEP-PROTOCOL: 2 block copies were never taken"):
        kv.begin_step()


def test_replay_step_limit_is_a_limit_error_not_a_violation():
    from kvproof.sim.replay import StepLimitError, replay
    from kvproof.sim.trace import TraceRequest

    layout = resolve_layout(LayoutConfig((CacheGroup(FA, 2), CacheGroup(MAMBA, 4)), max_model_len=64))
    trace = [TraceRequest("r", tuple(range(20)), output=(1, 2, 3))]
    with pytest.raises(StepLimitError, match="step limit of 3 steps with 1 request"):
        replay(trace, layout, 64, max_num_batched_tokens=4, max_steps=3)
    assert replay(trace, layout, 64, max_num_batched_tokens=4).violations == []


def test_replay_progress_contract_fires_on_a_step_that_schedules_nothing(monkeypatch):
    from kvproof.sim.replay import replay
    from kvproof.impl.scheduler import Scheduler, StepPlan
    from kvproof.sim.trace import TraceRequest

    def schedule_nothing(self):
        self.step += 1
        self.kv.begin_step()
        return StepPlan(self.step, [], [], [])

    monkeypatch.setattr(Scheduler, "schedule", schedule_nothing)
    layout = resolve_layout(LayoutConfig((CacheGroup(FA, 2), CacheGroup(MAMBA, 4)), max_model_len=64))
    result = replay([TraceRequest("r", tuple(range(20)), output=(1,))], layout, 64, max_num_batched_tokens=4)
    assert result.violations == ["INV-REPLAY-PROGRESS: step 1 scheduled no token with 0 request(s) waiting and 0 running"]


def test_mamba_partial_hit_inside_a_state_block():
    """FA2/M4, H 2: a 6-token producer; an 8-token request hits 6 with lists [3, 2]: attention
    shares three whole blocks, Mamba copies the state at 6 into a new block."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    producer = req("p", [1, 2, 3, 4, 5, 6], kv)
    run_chunks(kv, producer, [6])
    src = kv.block_table(producer)[1][1]
    hit, blocks, copies = run_chunk(kv, req("r", [1, 2, 3, 4, 5, 6, 7, 8], kv), 2)
    assert hit.num_tokens == 6 and [len(b) for b in hit.blocks] == [3, 2]
    assert [(g, s) for g, s, _ in copies] == [(1, src)]
    assert blocks[1][1] == copies[0][2]  # the request's state block is the copy


def test_same_step_hitter_copies_from_the_owners_block_not_from_its_copy():
    """The owner continues past its cached state at 6 while another request hits 6 in the same
    step: both copies read the original block at step start; they never chain."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4)])
    prompt = [3, 1, 4, 1, 5, 9, 2]
    owner = req("o", prompt, kv)
    run_chunks(kv, owner, [6])
    state = kv.block_table(owner)[1][1]
    with Step(kv) as step:
        step.schedule(owner, 1)
        assert step.schedule(req("h", prompt[:6] + [7, 7], kv), 2).hit.num_tokens == 6
    mamba = [(s, d) for g, s, d in step.copies if g == 1]
    assert [s for s, _ in mamba] == [state, state]
    assert not {d for _, d in mamba} & {s for s, _ in mamba}


def test_copy_sources_are_held_until_the_next_step_begins():
    kv = make_kv([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], hash_block_size=2)
    producer = req("p", [1, 2, 3, 4, 5, 6], kv)
    run_chunks(kv, producer, [6])
    kv.free(producer)
    _, _, copies = run_chunk(kv, req("r", [1, 2, 3, 4, 5, 6, 7, 8], kv), 2)
    sources = [s for _, s, _ in copies]
    assert sources and all(kv.pool.ref_count(s) == 1 for s in sources)  # only the hit's reference
    kv.begin_step()
    assert all(kv.pool.ref_count(s) == 0 for s in sources)  # released: evictable, still cached
    assert all(kv.pool.key_of(s) is not None for s in sources)


def test_speculative_blocks_follow_the_state():
    """Mamba 4 with 2 speculative blocks: the row holds the state and two scratch blocks after
    it; advancing reuses a scratch block as the new state and releases what falls below."""
    kv = make_kv([CacheGroup(FA, 2), CacheGroup(MAMBA, 4, num_speculative_blocks=2)])
    r = req("r", list(range(30)), kv)
    run_chunks(kv, r, [4])
    row = kv.block_table(r)[1]
    assert len(row) == 3 and all(row)  # state at index 0, scratch at 1 and 2
    scratch = row[1]
    run_chunks(kv, r, [4])
    row = kv.block_table(r)[1]
    assert len(row) == 4 and row[0] == 0 and row[1] == scratch and all(row[1:])
    run_chunks(kv, r, [12])
    row = kv.block_table(r)[1]
    assert len(row) == 7 and sum(1 for b in row if b) == 3 and all(row[4:])
    kv.check_request(r)
