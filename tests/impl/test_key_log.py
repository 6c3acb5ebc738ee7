"""The pool's key log (impl/key_log.py), INV-EVENTS-REPLAY: the pool state machine of
test_block_pool_machine.py, run on a pool that logs its keys, with one more invariant after every
step: replaying the log (stored adds a holder, removed takes one away and must find one, cleared
empties everything) gives exactly each key's holders in the pool. The machine's own invariants
(the spec model, the content oracle) hold for the logging pool too: logging changes nothing."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.key_index import KeyIndex
from kvproof.impl.key_log import CLEARED, REMOVED, STORED, KeyLog
from kvproof.spec.eviction import POLICIES

from ..conftest import PROFILE, Reach
from .test_block_pool_machine import PoolMachine

REACH = Reach()


class LoggedPoolMachine(PoolMachine):
    @initialize(num_blocks=st.integers(2, 8), policy=st.sampled_from(POLICIES))
    def start(self, num_blocks, policy):
        PoolMachine.start(self, num_blocks, policy)
        self.log = KeyLog()
        self.pool = BlockPool(num_blocks, policy=policy, key_log=self.log)
        self.replayed: Counter = Counter()

    @invariant()
    def the_log_replays_to_the_holders(self):
        for kind, key, num_tokens in self.log.take():
            if kind == STORED:
                assert num_tokens > 0
                self.replayed[key] += 1
            elif kind == REMOVED:
                assert self.replayed[key] > 0, f"the log removes {key!r}, which no block holds"
                self.replayed[key] -= 1
                REACH("removed a key")
            else:
                assert kind == CLEARED
                self.replayed.clear()
                REACH("cleared")
        live = +self.replayed
        assert {k: len(self.pool.holders(k)) for k in live} == dict(live)
        assert len(live) == self.pool.num_cached_keys(), "the pool holds keys the log never stored"
        if any(n > 1 for n in live.values()):
            REACH("a key with two holders")


class TestKeyLogReplaysToThePool(LoggedPoolMachine.TestCase):
    settings = settings(max_examples=100, stateful_step_count=50, deadline=None)

    @classmethod
    def setUpClass(cls):
        REACH.counts.clear()
        REACH.minimums = {"removed a key": 50, "cleared": 5, "a key with two holders": 5}

    @classmethod
    def tearDownClass(cls):
        if PROFILE == "ci":
            assert not REACH.shortfall(), f"the logged pool machine reached too few: {REACH.shortfall()} of {dict(REACH.counts)}"


def test_a_pool_without_a_log_runs_the_plain_index():
    assert type(BlockPool(4)._index) is KeyIndex
