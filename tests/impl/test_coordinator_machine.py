"""Stateful test of the whole scheduler side: requests that share prefixes arrive, are chunked
by the split rule, decode, finish and get preempted, under DCP 1-8 with EAGLE on or off.

After every step: the pool and the manager pass their whole-state checks, the content oracle
found every read correct on every rank, and for every waiting request the coordinator's joint
hit (a fixpoint of fast finders) equals the spec's (``kvproof.spec.joint_hit``: the largest
length every group can restore, checked candidate by candidate)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvproof.impl.content_oracle import ContentOracle
from kvproof.impl.hashing import key_at
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.managers import FullAttentionManager, MambaManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import CapacityError, Scheduler
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.joint_hit import ATTENTION, MAMBA, WINDOW, GroupView, joint_hit
from kvproof.spec.layout import LayoutConfig, resolve_layout

tokens = st.lists(st.integers(0, 7), min_size=1, max_size=40)


class CoordinatorMachine(RuleBasedStateMachine):
    prefixes = Bundle("prefixes")

    @initialize(
        dcp=st.sampled_from([1, 2, 4, 8]),
        fa_block=st.sampled_from([1, 2, 4]),
        mamba_block=st.sampled_from([2, 4, 8]),
        speculative=st.sampled_from([0, 0, 2]),
        window=st.none() | st.sampled_from([(2, 6), (4, 9)]),
        eagle=st.booleans(),
        partial=st.booleans(),
        num_blocks=st.sampled_from([24, 48, 256]),
        budget=st.sampled_from([4, 16, 64]),
    )
    def setup(self, dcp, fa_block, mamba_block, speculative, window, eagle, partial, num_blocks, budget):
        groups = [
            CacheGroup(GroupKind.FULL_ATTENTION, fa_block),
            CacheGroup(GroupKind.MAMBA, mamba_block, num_speculative_blocks=speculative),
        ]
        if window is not None:
            groups.append(CacheGroup(GroupKind.SLIDING_WINDOW, window[0], dcp_sharded=False, sliding_window=window[1]))
        self.layout = resolve_layout(
            LayoutConfig(tuple(groups), dcp=dcp, max_model_len=512, allow_partial_hash_hits=partial)
        )
        self.kv = KVCacheManager(self.layout, num_blocks, use_eagle=eagle)
        self.sched = Scheduler(self.kv, max_num_batched_tokens=budget)
        self.oracle = ContentOracle(self.layout)
        self.count = 0
        self.too_big = False

    @rule(target=prefixes, prefix=tokens)
    def new_prefix(self, prefix):
        return tuple(prefix)

    @precondition(lambda self: self.count < 12)
    @rule(prefix=prefixes, suffix=st.lists(st.integers(0, 7), max_size=12), outputs=st.lists(st.integers(0, 7), max_size=8),
          salt=st.sampled_from([None, None, "t1"]))
    def arrive(self, prefix, suffix, outputs, salt):
        self.count += 1
        r = Request(f"r{self.count}", list(prefix) + suffix, self.layout.hash_block_size, cache_salt=salt,
                    arrival=self.sched.step + 1, expected_outputs=outputs)
        self.sched.add_request(r)

    @precondition(lambda self: self.sched.has_unfinished() and not self.too_big)
    @rule()
    def step(self):
        try:
            plan = self.sched.schedule()
        except CapacityError:
            self.too_big = True  # a request larger than the whole pool: valid refusal
            return
        self.oracle.run_step(plan)
        for r in self.sched.finish_step(plan):
            self.oracle.forget(r)

    @invariant()
    def whole_state_consistent(self):
        if hasattr(self, "kv"):
            assert self.kv._check()

    @invariant()
    def contents_are_right_on_every_rank(self):
        if hasattr(self, "oracle"):
            assert self.oracle.violations == []

    @invariant()
    def joint_hit_matches_spec(self):
        if not hasattr(self, "kv"):
            return
        for r in list(self.sched.waiting):
            assert self.kv.lookup(r).num_tokens == self._spec_hit(r), r

    def _spec_hit(self, r: Request) -> int:
        h = self.layout.hash_block_size
        views = []
        for m in self.kv.managers:
            def has(n, m=m):
                return n <= r.hashed_len and self.kv.pool.lookup(key_at(r.block_hashes, n, h, m.group_id)) is not None
            if isinstance(m, MambaManager):
                views.append(GroupView(MAMBA, m.block_size, has))
            elif isinstance(m, FullAttentionManager):
                views.append(GroupView(ATTENTION, m.block_size, has, eagle_unit=m._eagle_unit))
            else:
                views.append(GroupView(WINDOW, m.block_size, has, window=m.window))
        return joint_hit(tuple(views), r.num_tokens - 1, self.kv.coordinator.alignment, h, r.hashed_len)


CoordinatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCoordinatorMachine = CoordinatorMachine.TestCase
