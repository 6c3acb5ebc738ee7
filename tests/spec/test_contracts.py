"""The one slow switch (spec/contracts.py), read at call time and tested both ways; validation
that survives ``python -O``; ``HYPOTHESIS_PROFILE=thorough`` reaching every property test."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import icontract
import pytest

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.key_index import KeyIndex
from kvproof.spec import contracts
from kvproof.spec.contracts import InvariantViolation

ROOT = pathlib.Path(__file__).resolve().parents[2]


def corrupt(pool: BlockPool) -> None:
    """A keyless block that records a prefix length: only the whole-pool check sees it."""
    pool._index.ntok[4] = 5


def test_slow_switch_is_read_at_call_time_both_ways():
    with contracts.slow_checks(False):
        pool = BlockPool(5)
        corrupt(pool)
        pool.allocate(1)  # off: the corruption goes unnoticed, the verb runs bare
        assert not contracts.slow()
        with contracts.slow_checks(True):  # flipped after the pool (and its decorators) exist
            with pytest.raises(InvariantViolation, match="INV-POOL-KEY-CONSISTENT: block 4"):
                pool.allocate(1)
        pool.allocate(1)  # back off
    contracts.set_slow(True)
    try:
        with pytest.raises(InvariantViolation, match="INV-POOL-KEY-CONSISTENT: block 4"):
            pool.allocate(1)
    finally:
        contracts.set_slow(True)  # the suite runs with it on (tests/conftest.py)


def test_slow_switch_takes_only_a_bool():
    with pytest.raises(ValueError, match="the slow switch takes a bool, got 'yes'"):
        contracts.set_slow("yes")


def test_cheap_conditions_stay_on_with_the_switch_off(monkeypatch):
    """evict's INV-POOL-PREFIX-KEYS postcondition is cheap (O(blocks touched)): always on."""
    monkeypatch.setattr(KeyIndex, "drop", lambda self, b: None)
    with contracts.slow_checks(False):
        pool = BlockPool(4)
        (b,) = pool.allocate(1)
        pool.cache_full(b, ("k", 0), 2)
        with pytest.raises(icontract.ViolationError, match="INV-POOL-PREFIX-KEYS"):
            pool.evict([b])


def _tiered():
    """A function with one cheap and one slow postcondition, each recording that it ran."""
    ran = []

    @contracts.ensure(lambda result: ran.append("cheap") or True, "cheap ran", tier=contracts.CHEAP)
    @contracts.ensure(lambda result: ran.append("slow") or True, "slow ran", tier=contracts.SLOW)
    def f() -> int:
        return 1

    return f, ran


@pytest.mark.parametrize("slow", [False, True])
def test_the_tier_declared_with_a_condition_decides_when_it_runs(slow):
    """A cheap condition runs whatever the switch; a slow one only while it is on."""
    f, ran = _tiered()
    with contracts.slow_checks(slow):
        assert f() == 1
    assert sorted(ran) == (["cheap", "slow"] if slow else ["cheap"])


@pytest.mark.parametrize("tier", [contracts.CHEAP, contracts.SLOW])
def test_a_condition_of_either_tier_fires_when_its_switch_lets_it_run(tier):
    @contracts.ensure(lambda result: result > 0, "INV-TOY: result must be positive", tier=tier)
    def f() -> int:
        return 0

    with contracts.slow_checks(True):
        with pytest.raises(icontract.ViolationError, match="INV-TOY"):
            f()
    with contracts.slow_checks(False):
        if tier == contracts.CHEAP:
            with pytest.raises(icontract.ViolationError, match="INV-TOY"):
                f()
        else:
            assert f() == 0


def test_a_snapshot_is_taken_only_where_its_tier_runs():
    taken = []

    @contracts.snapshot(lambda: taken.append(1) or 1, name="one", tier=contracts.SLOW)
    @contracts.ensure(lambda OLD: OLD.one == 1, "slow reads OLD", tier=contracts.SLOW)
    def f() -> None:
        pass

    with contracts.slow_checks(False):
        f()
    assert taken == []
    with contracts.slow_checks(True):
        f()
    assert taken == [1]


def test_an_unknown_tier_is_refused_naming_it():
    with pytest.raises(ValueError, match="contract tier 'fast' must be one of cheap, slow"):
        contracts.ensure(lambda: True, "x", tier="fast")


# Each line: a bad call, and the start of the message it must raise. Run under `python -O`.
BAD_INPUT = r'''
import sys
from kvproof.impl.block_pool import BlockPool
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.spec import arith, geometry, placement
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout
assert not __debug__, "this script must run under python -O"

def snapshot(p):
    keys = p._index
    return (list(p._ref), list(keys.key), list(keys.ntok), p.free_order(), dict((k, list(v)) for k, v in keys.holders.items()))

pool = BlockPool(4)
pool.allocate(2)
pool.cache_full(1, ("k", 0), 2)
before = snapshot(pool)
layout = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4), CacheGroup(GroupKind.MAMBA, 4))))
kv = KVCacheManager(layout, 16)
req = Request("r", [1, 2, 3], layout.hash_block_size)
kv.begin_step()
kv_before = snapshot(kv.pool)
cases = [
    (lambda: BlockPool(2 ** 70), "num_blocks 1180591620717411303424 must be an int in [1, 2147483647]"),
    (lambda: kv.allocate_slots(req, True), "request 'r': num_new_tokens True must be an int > 0"),
    (lambda: kv.lookup(req, bound=-5), "request 'r': bound -5 must be None or an int >= 0"),
    (lambda: kv.cache(req), "request 'r' holds no blocks"),
    (lambda: BlockPool(0), "num_blocks 0 must be an int in [1, "),
    (lambda: pool.evict([-1]), "evict: block id -1 out of range [1, 4)"),
    (lambda: pool.evict([4]), "evict: block id 4 out of range [1, 4)"),
    (lambda: pool.move_key(1, 1), "INV-POOL-HELD-TO-CACHE: move_key needs two distinct held real blocks"),
    (lambda: pool.move_key(2, 1), "move_key: block 2 must have a key and block 1 none"),
    (lambda: pool.allocate(-1), "allocate: block count -1 must be an int >= 0"),
    (lambda: pool.free([3]), "INV-POOL-REF-NONNEG: free of block 3 with ref count 0"),
    (lambda: pool.cache_full(0, ("z", 0), 2), "INV-POOL-NULL"),
    (lambda: arith.cdiv(1, 0), "cdiv divisor 0 must be > 0"),
    (lambda: geometry.effective_block_size(CacheGroup(GroupKind.MAMBA, 4, dcp_sharded=True), 2), "INV-GEOM-MAMBA-REPLICATED"),
    (lambda: geometry.max_num_blocks_per_req(CacheGroup(GroupKind.MAMBA, 4), 1, 0), "max_model_len 0 must be > 0"),
    (lambda: CacheGroup(GroupKind.SLIDING_WINDOW, 4), "sliding window None of a sliding_window group must be a positive"),
    (lambda: placement.owner_rank(-1, 2, 1), "position -1 must be >= 0"),
    (lambda: placement.local_seq_len(4, 2, 2, 1), "rank 2 must lie in [0, dcp 2)"),
]
for call, message in cases:
    try:
        call()
    except ValueError as e:
        if not str(e).startswith(message):
            sys.exit(f"wrong message: {e!r}, expected {message!r}")
    else:
        sys.exit(f"accepted under -O; expected ValueError {message!r}")
if snapshot(pool) != before or snapshot(kv.pool) != kv_before or req.num_computed_tokens:
    sys.exit("a refused call changed the pool")
print("ok", len(cases))
'''


def test_bad_input_is_refused_under_python_O():
    env = {k: v for k, v in os.environ.items() if k != "ICONTRACT_SLOW"}
    proc = subprocess.run([sys.executable, "-O", "-c", BAD_INPUT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok 18"), proc.stdout + proc.stderr


def test_the_thorough_profile_reaches_every_property_test(tmp_path):
    """Collect the whole suite under HYPOTHESIS_PROFILE=thorough: every @given test and every
    state machine gets the profile's 2000 examples, whatever it fixes for the everyday run."""
    report = tmp_path / "reached.tsv"
    env = {**os.environ, "HYPOTHESIS_PROFILE": "thorough", "KVPROOF_PROFILE_REPORT": str(report)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    reached = dict(line.split("\t") for line in report.read_text().splitlines())
    # Declared in the modules that were collected: one skipped as a whole (tests/vllm without
    # vLLM) declares nothing this run can reach, whatever is installed.
    collected = {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}
    declared = sum(
        p.read_text().count("@given(") + p.read_text().count("(RuleBasedStateMachine)")
        for p in (ROOT / "tests").rglob("test_*.py")
        if p.name != "test_contracts.py"  # this file names both in its text
        and p.relative_to(ROOT).as_posix() in collected
    )
    assert len(reached) >= declared >= 20, (len(reached), declared)
    assert all(int(n) >= 2000 for n in reached.values()), reached
    assert any("test_block_pool_machine.py" in n for n in reached) and any("test_coordinator_machine.py" in n for n in reached)


@pytest.mark.parametrize("slow", [False, True])
def test_replay_slow_turns_the_switch_on_for_the_run(slow):
    """`kvproof replay --slow` (replay(slow=True)) runs every call with the slow switch on."""
    from kvproof.sim.replay import replay
    from kvproof.sim.trace import TraceRequest
    from kvproof.spec.groups import CacheGroup, GroupKind
    from kvproof.spec.layout import LayoutConfig, resolve_layout

    layout = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4), CacheGroup(GroupKind.MAMBA, 4))))
    seen = []
    with contracts.slow_checks(False):
        replay([TraceRequest("r", tuple(range(9)), (1, 2))], layout, 16, on_step=lambda plan, s: seen.append(contracts.slow()))
        assert not contracts.slow()
    assert seen and set(seen) == {False}
    with contracts.slow_checks(False):
        replay([TraceRequest("r", tuple(range(9)), (1, 2))], layout, 16, slow=slow,
               on_step=lambda plan, s: seen.append(contracts.slow()))
    assert set(seen[-2:]) == {slow}


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("0", False), ("false", False), ("", False), (None, False)])
def test_the_switch_starts_from_icontract_slow(value, on):
    env = {k: v for k, v in os.environ.items() if k != "ICONTRACT_SLOW"}
    if value is not None:
        env["ICONTRACT_SLOW"] = value
    proc = subprocess.run([sys.executable, "-c", "from kvproof.spec import contracts; print(contracts.slow())"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip() == str(on), proc.stderr
