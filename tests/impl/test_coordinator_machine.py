"""Stateful test of the whole scheduler side: requests built from shared system prompts,
siblings cut near block and hash boundaries and continuations of earlier turns arrive, are
chunked by the split rule (junction stops included), decode, finish and get preempted, under
DCP 1-8, every retention interval, EAGLE on or off.

After every step:
- the pool and the manager pass their whole-state checks, and the content oracle found every
  read correct on every rank;
- for every waiting request, the coordinator's joint hit equals the spec's
  (``kvproof.spec.joint_hit``: the largest length every group can restore, candidate by
  candidate, with the group views built from the *layout*), and each group's hit blocks really
  hold that prefix (their keys are this request's hashes);
- every admitted request with a hit inside a group's block got exactly one copy into that
  row position; every allocation took exactly ``blocks_needed`` blocks from the free queue;
- liveness: a request is refused (CapacityError) only if it cannot run alone from an empty
  pool either (no hit, same budget);
- INV-KEYS-EVERY-HASH, stated from the layout: with every-hash attention keys each running
  request's block holding a hash boundary it computed since its hit carries that key.

A second machine runs the same rules on one full-attention group hashed finer than its block
(attention alone), where hits land at boundaries no chunk ended at.

The run counts what the lookups and steps reached (no hit, block-aligned, partial, junction,
copy-on-write, eviction, preemption); a fixed-seed (``ci``) run fails below set minimums.
"""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvproof.impl.block_pool import NULL_BLOCK
from kvproof.impl.hashing import key_at
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import CapacityError, Scheduler
from kvproof.oracle.content_oracle import ContentOracle
from kvproof.sim.drive import drain
from kvproof.spec.checkpoints import REUSE, VLLM
from kvproof.spec.eviction import COMPUTE, LRU
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.joint_hit import ATTENTION, MAMBA, WINDOW, GroupView, joint_hit
from kvproof.spec.layout import Layout, LayoutConfig, resolve_layout

from ..conftest import PROFILE, Reach

#: What the machines of one run reached (the test case checks it after its last example).
REACH = Reach()
#: The same for the attention-alone machine.
REACH_ALONE = Reach()


def spec_views(layout: Layout, request: Request, pool, eagle: bool) -> tuple[GroupView, ...]:
    """The joint-hit spec's view of every group, from the layout alone (never the managers)."""
    h = layout.hash_block_size
    views = []
    for g in layout.groups:
        def has(n, gid=g.index):
            return n <= request.hashed_len and pool.lookup(key_at(request.block_hashes, n, h, gid)) is not None
        b = g.effective_block_size
        if g.group.kind is GroupKind.MAMBA:
            views.append(GroupView(MAMBA, b, has))
        elif g.group.kind is GroupKind.SLIDING_WINDOW:
            views.append(GroupView(WINDOW, b, has, window=g.group.sliding_window))
        else:
            # The EAGLE draft recomputes one unit (the layout's rule, not the manager's copy of it).
            views.append(GroupView(ATTENTION, b, has, eagle_unit=layout.eagle_unit(g) if eagle else 0))
    return tuple(views)


def runs_alone(layout: Layout, request: Request, num_blocks: int, budget: int, eagle: bool) -> bool:
    """Whether ``request`` (its prompt and outputs) runs to completion alone, from an empty pool
    of ``num_blocks`` with the same budget: what "fits without a hit" means for this scheduler."""
    kv = KVCacheManager(layout, num_blocks, use_eagle=eagle)
    sched = Scheduler(kv, max_num_batched_tokens=budget)
    sched.add_request(Request("alone", request.token_ids[: request.num_prompt_tokens], layout.hash_block_size,
                              cache_salt=request.cache_salt, expected_outputs=request.expected_outputs))
    try:
        drain(sched)
    except CapacityError:
        return False
    return True


class CoordinatorMachine(RuleBasedStateMachine):
    histories = Bundle("histories")
    reach = REACH

    @initialize(
        dcp=st.sampled_from([1, 2, 4, 8]),
        fa_block=st.sampled_from([1, 2, 4]),
        mamba_factor=st.sampled_from([1, 2, 4]),
        speculative=st.sampled_from([0, 0, 2]),
        # A window group (or partial hits off) forces block-aligned hits: one machine in four.
        window=st.sampled_from([None, None, None, (2, 6), (4, 9)]),
        eagle=st.booleans(),
        partial=st.sampled_from([True, True, True, False]),
        retention=st.sampled_from(["none", "0", "K"]),
        exact_junction=st.booleans(),
        finer_hash=st.booleans(),
        num_blocks=st.sampled_from([16, 24, 24, 48, 256]),
        budget=st.sampled_from([4, 16, 64]),
        attention_keys=st.sampled_from(["every-hash", "every-hash", "chunk-ends", "prompt-tail"]),
    )
    def setup(self, dcp, fa_block, mamba_factor, speculative, window, eagle, partial, retention, exact_junction,
              finer_hash, num_blocks, budget, attention_keys):
        # The eviction policy follows the budget rather than a draw of its own, so the fixed-seed
        # run keeps reaching the cases it reached before the policy existed (one machine in three
        # runs the compute policy).
        eviction = COMPUTE if budget == 16 else LRU
        # Likewise the checkpoint policy: the turn-end ladder in one machine in three.
        checkpoints = REUSE if budget == 64 else VLLM
        if checkpoints == REUSE:
            self.reach("checkpoints: reuse")
        groups = [
            CacheGroup(GroupKind.FULL_ATTENTION, fa_block),
            CacheGroup(GroupKind.MAMBA, fa_block * mamba_factor, num_speculative_blocks=speculative),
        ]
        if window is not None:
            groups.append(CacheGroup(GroupKind.SLIDING_WINDOW, window[0], dcp_sharded=False, sliding_window=window[1]))
        # H finer than every block (hits inside blocks), or derived (often equal to S).
        h = (fa_block // 2 or 1) if finer_hash and fa_block * min(dcp, mamba_factor) > 1 else None
        base = LayoutConfig(tuple(groups), dcp=dcp, max_model_len=512, hash_block_size=h, allow_partial_hash_hits=partial,
                            shared_prefix_checkpoint=exact_junction, eviction=eviction, attention_keys=attention_keys,
                            checkpoints=checkpoints)
        interval = {"none": None, "0": 0, "K": 2 * resolve_layout(base).scheduler_block_size}[retention]
        self._start(resolve_layout(dataclasses.replace(base, retention_interval=interval)), num_blocks, budget, eagle)

    def _start(self, layout: Layout, num_blocks: int, budget: int, eagle: bool) -> None:
        self.layout = layout
        self.num_blocks, self.budget, self.eagle = num_blocks, budget, eagle
        self.kv = KVCacheManager(self.layout, num_blocks, use_eagle=eagle)
        self.sched = Scheduler(self.kv, max_num_batched_tokens=budget)
        self.oracle = ContentOracle(self.layout)
        self.count = 0
        self.too_big = False
        self.fresh = itertools.count(100)
        # Keys of every chunk end so far (attention group 0), and where each running request's
        # own writing began (its hit at its last admission): for INV-KEYS-EVERY-HASH.
        self.chunk_end_keys: set = set()
        self.own_start: dict[str, int] = {}
        self._wrap_allocate()

    def _wrap_allocate(self) -> None:
        """Every allocation takes exactly what ``blocks_needed`` said, from the free queue; every
        lookup the scheduler makes is labelled."""
        kv, coordinator = self.kv, self.kv.coordinator
        real = kv.allocate_slots
        self._lookup = real_lookup = kv.lookup

        def lookup(request, bound=None):
            hit = real_lookup(request, bound)
            self._label(request, hit)
            return hit

        kv.lookup = lookup

        def allocate_slots(request, num_new_tokens, hit=None):
            running = kv.is_running(request)
            start = request.num_computed_tokens if running else (hit.num_tokens if hit is not None else 0)
            total = start + num_new_tokens
            needed = coordinator.blocks_needed(request, total, None if running else hit or coordinator.miss)
            before = kv.pool.num_free
            result = real(request, num_new_tokens, hit)
            if result is not None:
                assert before - kv.pool.num_free == needed, (request, total, before, kv.pool.num_free, needed)
            return result

        kv.allocate_slots = allocate_slots

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(next(self.fresh) for _ in range(n))

    @rule(target=histories, k=st.integers(1, 6), d=st.sampled_from([-1, 0, 1, 2]),
          unit=st.sampled_from(["hash", "block", "scheduler"]))
    def system_prompt(self, k, d, unit):
        """A shared system prompt whose length sits at or next to a block or hash boundary."""
        size = {"hash": self.layout.hash_block_size, "block": self.layout.groups[0].effective_block_size,
                "scheduler": self.layout.scheduler_block_size}[unit]
        return self._tokens(min(max(1, size * k + d), 48))

    @precondition(lambda self: self.count < 12)
    @rule(target=histories, history=histories, cut=st.integers(0, 8), how=st.sampled_from(["sibling", "continue", "resend"]),
          suffix=st.integers(0, 12), outputs=st.integers(0, 6), salt=st.sampled_from([None, None, None, "t1"]))
    def arrive(self, history, cut, how, suffix, outputs, salt):
        """A request on an earlier history: a sibling cut a few tokens short of its end (or at
        it), a continuation (history + a new turn), or an identical resend."""
        if how == "sibling":
            prompt = history[: max(1, len(history) - cut)] + self._tokens(suffix)
        elif how == "continue":
            prompt = history + self._tokens(max(suffix, 1))
        else:
            prompt = history
        prompt = prompt[:96]
        out = self._tokens(outputs)
        self.count += 1
        r = Request(f"r{self.count}", list(prompt), self.layout.hash_block_size, cache_salt=salt,
                    arrival=self.sched.step + 1, expected_outputs=out)
        self.sched.add_request(r)
        self.reach(f"arrival: {how}")
        # Later turns build on this prompt, and on this prompt plus its outputs.
        return multiple(prompt, prompt + out)

    @precondition(lambda self: self.sched.has_unfinished() and not self.too_big)
    @rule()
    def run_to_idle(self):
        """Steps until every request has finished, so the next arrivals find finished
        producers (the non-overlapping traffic of a chat turn after turn)."""
        for _ in range(300):
            if not self.sched.has_unfinished() or self.too_big:
                return
            self.step()

    @precondition(lambda self: self.sched.has_unfinished() and not self.too_big)
    @rule()
    def step(self):
        evictions = self.kv.pool.num_evictions
        waiting = {r.request_id for r in self.sched.waiting} | {r.request_id for r in self.sched.pending}
        try:
            plan = self.sched.schedule()
        except CapacityError as e:
            refused = next(r for r in [*self.sched.waiting, *self.sched.running] if r.request_id == e.request_id)
            assert not runs_alone(self.layout, refused, self.num_blocks, self.budget, self.eagle), (
                f"{refused} runs alone in an empty pool, yet was refused")
            self.too_big = True
            return
        self._check_admission_copies(plan, waiting)
        self.oracle.run_step(plan)
        if plan.copies:
            self.reach("copy-on-write")
        if self.kv.pool.num_evictions > evictions:
            self.reach("eviction")
            self.reach(f"eviction: {self.kv.pool.policy}")
        if plan.preempted:
            self.reach("preemption")
        h = self.layout.hash_block_size
        for c in plan.chunks:
            if c.overwrite:
                self.own_start[c.request.request_id] = c.start
        for r in self.sched.finish_step(plan):
            self.oracle.forget(r)
        for c in plan.chunks:
            end = min(c.start + c.num_tokens, c.request.hashed_len)
            if end >= h:
                self.chunk_end_keys.add(key_at(c.request.block_hashes, end - end % h, h, 0))

    def _check_admission_copies(self, plan, waiting) -> None:
        """An admitted request whose hit ends inside a group's block has a copy into its row
        there (and only there): the block it will append to is its own."""
        copies = {(gid, dst) for gid, _, dst in plan.copies}
        for chunk in plan.chunks:
            if not chunk.overwrite or chunk.request.request_id not in waiting or chunk.start == 0:
                continue
            for g, row in zip(self.layout.groups, chunk.new_blocks):
                b = g.effective_block_size
                if chunk.start % b and g.group.kind is not GroupKind.SLIDING_WINDOW:
                    assert (g.index, row[chunk.start // b]) in copies, (chunk.request, g.index, plan.copies)

    @invariant()
    def whole_state_consistent(self):
        if hasattr(self, "kv"):
            assert self.kv.check_state()

    @invariant()
    def every_hash_boundary_written_has_a_key(self):
        """INV-KEYS-EVERY-HASH, stated from the layout: with every-hash keys (and hits that may
        end inside a block), each running request's attention block holding a hash boundary it
        has computed since its hit carries that boundary's key; with chunk-end keys, at least
        each block end."""
        if not hasattr(self, "kv"):
            return
        g = self.layout.groups[0]
        b, h = g.effective_block_size, self.layout.hash_block_size
        every = self.layout.config.attention_keys == "every-hash" and self.layout.cache_hit_alignment < b
        unit = h if every else b
        row_of = self.kv.coordinator.managers[0].row
        for r in self.sched.running:
            table, start = row_of(r.request_id), self.own_start[r.request_id]
            done = min(r.num_computed_tokens, r.hashed_len)
            for n in range(start - start % unit + unit, done + 1, unit):
                keys = {k for k, _ in self.kv.pool.keys_of(table[(n - 1) // b])}
                assert key_at(r.block_hashes, n, h, 0) in keys, (r, n, start, done, self.layout.config.attention_keys)

    @invariant()
    def contents_are_right_on_every_rank(self):
        if hasattr(self, "oracle"):
            assert self.oracle.violations == []

    @invariant()
    def joint_hit_matches_spec_and_its_blocks_hold_the_prefix(self):
        if not hasattr(self, "kv"):
            return
        for r in list(self.sched.waiting):
            hit = self._lookup(r)
            want = joint_hit(spec_views(self.layout, r, self.kv.pool, self.eagle), r.num_tokens - 1,
                             self.kv.coordinator.alignment, self.layout.hash_block_size, r.hashed_len)
            assert hit.num_tokens == want, (r, hit, want)
            self._check_hit_blocks(r, hit)

    def _label(self, request, hit) -> None:
        n, h = hit.num_tokens, self.layout.hash_block_size
        if n == 0:
            self.reach("lookup: no hit")
        elif n % self.layout.scheduler_block_size == 0:
            self.reach("lookup: block-aligned hit")
        else:
            self.reach("lookup: partial hit")
            key = key_at(request.block_hashes, n, h, 0)
            if n % self.layout.groups[0].effective_block_size and key not in self.chunk_end_keys and self.kv.pool.lookup(key):
                self.reach("lookup: hit inside a block at a boundary that was no chunk end")
        if hit.junctions:
            self.reach("lookup: junction")

    def _check_hit_blocks(self, r: Request, hit) -> None:
        """Each group's hit blocks hold this request's prefix: attention blocks below the hit
        carry their full-block key, the block holding the hit's end a key of this prefix at or
        past the hit (its primary or a prefix key); a Mamba list is nulls then the state keyed at
        exactly the hit."""
        n, h, pool = hit.num_tokens, self.layout.hash_block_size, self.kv.pool
        if n == 0:
            return
        for g, blocks in zip(self.layout.groups, hit.blocks):
            b = g.effective_block_size
            if g.group.kind is GroupKind.MAMBA:
                assert all(x == NULL_BLOCK for x in blocks[:-1])
                assert pool.key_of(blocks[-1]) == key_at(r.block_hashes, n, h, g.index), (r, g.index, blocks)
                continue
            for j, block in enumerate(blocks):
                if block == NULL_BLOCK:
                    assert g.group.kind is GroupKind.SLIDING_WINDOW
                    continue
                end = min((j + 1) * b, r.hashed_len)
                lowest = n if (j + 1) * b > n else (j + 1) * b
                wanted = {key_at(r.block_hashes, m, h, g.index) for m in range(lowest, end + 1, h) if m % h == 0 and m > 0}
                assert {k for k, _ in pool.keys_of(block)} & wanted, (r, g.index, j, block)


class TestCoordinatorMachine(CoordinatorMachine.TestCase):
    settings = settings(max_examples=120, stateful_step_count=40, deadline=None)

    @classmethod
    def setUpClass(cls):
        REACH.counts.clear()
        REACH.minimums = {"lookup: partial hit": 20, "lookup: junction": 20, "lookup: block-aligned hit": 20,
                          "copy-on-write": 20, "eviction": 10, "eviction: compute": 5, "preemption": 5, "arrival: continue": 20,
                          "checkpoints: reuse": 10}

    @classmethod
    def tearDownClass(cls):
        if PROFILE == "ci":  # a fixed-seed run must reach the hard cases
            assert not REACH.shortfall(), f"the machines reached too few: {REACH.shortfall()} of {dict(REACH.counts)}"


class AttentionAloneMachine(CoordinatorMachine):
    """The same rules on one full-attention group hashed finer than its block (so hits land
    inside blocks with no Mamba state to wait for), mostly with every-hash keys: a consumer
    diverging inside a block hits at a boundary no chunk ended at (INV-KEYS-EVERY-HASH)."""

    reach = REACH_ALONE

    @initialize(
        dcp=st.sampled_from([1, 2, 4, 8]),
        fa_block=st.sampled_from([2, 4]),
        eagle=st.booleans(),
        partial=st.sampled_from([True, True, True, False]),
        num_blocks=st.sampled_from([16, 24, 48, 256]),
        budget=st.sampled_from([4, 16, 64]),
        attention_keys=st.sampled_from(["every-hash", "every-hash", "chunk-ends", "prompt-tail"]),
    )
    def setup(self, dcp, fa_block, eagle, partial, num_blocks, budget, attention_keys):
        config = LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, fa_block),), dcp=dcp, max_model_len=512,
                              hash_block_size=fa_block // 2, allow_partial_hash_hits=partial, attention_keys=attention_keys)
        self._start(resolve_layout(config), num_blocks, budget, eagle)


class TestAttentionAloneMachine(AttentionAloneMachine.TestCase):
    settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

    @classmethod
    def setUpClass(cls):
        REACH_ALONE.counts.clear()
        REACH_ALONE.minimums = {"lookup: hit inside a block at a boundary that was no chunk end": 10,
                                "lookup: partial hit": 20, "copy-on-write": 10}

    @classmethod
    def tearDownClass(cls):
        if PROFILE == "ci":
            assert not REACH_ALONE.shortfall(), f"the machines reached too few: {REACH_ALONE.shortfall()} of {dict(REACH_ALONE.counts)}"
