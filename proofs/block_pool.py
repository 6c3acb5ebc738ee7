"""Exhaustive small-scope check of the block-pool model (spec/block_pool.py).

Every sequence of pool operations up to a fixed depth, from ``initial(num_blocks)``, with the
spec's contracts on: a breadth-first search over the reachable states (``PoolState`` is frozen,
so states are deduplicated and each one's moves are tried once). From every state reached in
fewer than ``depth`` steps it makes every call of a fixed menu -- allocate, touch, free, evict,
full and partial caching (with and without ``replace`` and ``keep_prefixes``), reset, move_key -- over every block id
(the null block and one id past the end included) and a few keys with fixed lengths.

A call may be *refused*: a ``ValueError`` raised by one of the spec's preconditions (bad input;
the pool is a pure function, so a refusal changes nothing). Anything else that escapes -- a
postcondition (``icontract.ViolationError``), a crash, a ``ValueError`` from the body -- is a
counterexample. After every accepted call the new state must be ``well_formed`` (which holds
every whole-state invariant), and the call must obey a few rules stated here from the docs
rather than read off the contracts (``transition_fact_broken``): caching and key moves touch
only held real blocks, a key never covers fewer tokens than the one it replaced unless the caller
said the state was rewritten (``replace``), a block keeps its older keys exactly when asked
(``keep_prefixes``), ``cache_partial`` refuses *exactly* a boundary the
block has outgrown (its contract states only one direction), ``allocate`` takes the head of the
free queue, ``touch``/``free`` move each listed real block's ref count by one per mention.

Because a state's moves are tried from its first (shortest) visit, every sequence of at most
``depth`` calls is covered: its states are all reached within that many steps. The scope is
fixed, so the verdict is the same on every machine; pools are unbounded, so a clean run is
``unrefuted``.
"""

from __future__ import annotations

import dataclasses

import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import icontract

from kvproof.proofs.registry import CHECKED, ERROR, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec import block_pool as pool
from kvproof.spec.block_pool import PoolState
from kvproof.spec.contracts import guard_like
from kvproof.spec.eviction import COMPUTE, LRU

#: (pool size, calls per sequence): block 0 is the null block, so two real blocks with sequences of
#: up to six calls, then three real blocks with up to four (about 6 s and 2 s on 2 cores).
SCOPES = ((3, 6), (4, 4))
#: Full-block keys of two different prefixes (a block holds 4 tokens).
FULL_KEYS = (("F4", 4), ("G4", 4))
#: Partial (sub-block) boundaries of the F prefix, and one offer of F2 at a length it does not
#: name (refused by INV-POOL-KEY-LENGTH once some block holds F2).
PARTIAL_KEYS = (("F2", 2), ("F3", 3), ("F2", 3))

INVARIANTS = (
    "INV-POOL-NULL", "INV-POOL-REF-NONNEG", "INV-POOL-FREE-IFF-UNREF", "INV-POOL-CONSERVE",
    "INV-POOL-KEY-CONSISTENT", "INV-POOL-KEY-LENGTH", "INV-POOL-NO-STALE-PARTIAL", "INV-POOL-PREFIX-KEYS", "INV-POOL-ATOMIC",
    "INV-POOL-ALLOC-FRESH", "INV-POOL-HELD-TO-CACHE", "INV-POOL-RESET-IDLE",
)


@dataclass(frozen=True)
class Call:
    """One pool operation with its arguments (the state comes first and is not shown)."""

    op: str
    args: tuple

    def __str__(self) -> str:
        return f"{self.op}({', '.join(repr(list(a)) if isinstance(a, tuple) else repr(a) for a in self.args)})"


#: The operations the search drives, by name; a canary swaps one for a seeded wrong version.
Ops = dict[str, Callable]

SPEC_OPS: Ops = {
    name: getattr(pool, name)
    for name in ("allocate", "touch", "free", "evict", "cache_full", "cache_partial", "reset", "move_key", "requeue")
}
#: The compute eviction policy: two real blocks, sequences of up to five calls; releases carry
#: values from this menu (equal ones tie, and the release order must break the tie).
COMPUTE_SCOPES = ((3, 5),)
VALUE_MENU = (0.0, 3.0)


def moves(s: PoolState) -> Iterator[Call]:
    """Every call of the menu on ``s``, in a fixed order."""
    ids = range(s.num_blocks + 1)  # the null block, the real ones, one past the end
    lists = [(b,) for b in ids] + [(1, 2), (2, 1), (1, 1)]
    for n in range(len(s.free) + 2):  # one more than is free: allocate must fail atomically
        yield Call("allocate", (n,))
    for blocks in lists:
        yield Call("touch", (blocks,))
    for blocks in lists:
        yield Call("free", (blocks,))
    if s.policy == COMPUTE:
        for b in range(1, s.num_blocks):
            for v in VALUE_MENU:
                yield Call("free", ((b,), (v,)))
                yield Call("requeue", ((b,), (v,)))
        yield Call("free", ((1, 2), (VALUE_MENU[1], VALUE_MENU[0])))
    for b in ids:
        yield Call("requeue", ((b,),))
    for b in ids:
        yield Call("evict", ((b,),))
    for b in range(s.num_blocks):
        for key, n in FULL_KEYS:
            for keep in (False, True):
                yield Call("cache_full", (b, key, n, keep))
        for key, n in PARTIAL_KEYS:
            for replace, keep in ((False, False), (True, False), (False, True), (True, True)):
                yield Call("cache_partial", (b, key, n, replace, keep))
    yield Call("reset", ())
    for src in range(s.num_blocks):
        for dst in range(s.num_blocks):
            yield Call("move_key", (src, dst))


def _refused_by_a_precondition(error: ValueError) -> bool:
    """A spec precondition raises its ValueError from icontract's wrapper, before the body runs;
    a ValueError from the body (``list.remove`` of a missing block, say) is a bug, not a refusal."""
    innermost = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        innermost = frame
    return innermost is not None and "icontract" in innermost.f_code.co_filename


def _next_state(call: Call, result) -> Optional[PoolState]:
    """The state after an accepted call (None when allocate failed: nothing changed)."""
    if call.op in ("touch", "free", "evict", "move_key", "requeue"):
        return result
    if call.op == "allocate":
        return None if result is None else result[0]
    return result[0]  # cache_full, cache_partial, reset


def _held(s: PoolState, b: int) -> bool:
    return 0 < b < s.num_blocks and s.ref[b] > 0


def transition_fact_broken(call: Call, s: PoolState, result, t: Optional[PoolState]) -> Optional[str]:
    """What the docs say about one accepted call, checked from the states before (``s``) and after (``t``)."""
    op, args = call.op, call.args
    if op == "allocate":
        (n,) = args
        if n > len(s.free):
            return None if result is None else f"{n} blocks allocated with {len(s.free)} free"
        taken = result[1]
        if s.policy == COMPUTE:
            return _compute_choice_broken(s, taken)
        if taken != s.free[:n]:
            return f"took {list(taken)}, not the head of the free queue {list(s.free[:n])}"
        return None
    if op in ("touch", "free"):
        sign = 1 if op == "touch" else -1
        count = Counter(b for b in args[0] if b != pool.NULL_BLOCK)
        for b in range(s.num_blocks):
            if t.ref[b] != s.ref[b] + sign * count[b]:
                return f"block {b}'s ref count went {s.ref[b]} -> {t.ref[b]}, listed {count[b]} time(s)"
        return None
    if op in ("cache_full", "cache_partial"):
        b, key, n = args[:3]
        replace, keep = (args[3], args[4]) if op == "cache_partial" else (False, args[3])
        before = {k for k, _ in pool.keys_of(s, b)}
        outgrown = key not in before and s.ntok[b] >= n
        if op == "cache_partial" and not replace and outgrown and result[1] is not None:
            return (
                f"block {b} covered {s.ntok[b]} tokens under {s.key[b]!r}; the boundary {n} it has outgrown "
                f"was accepted, not refused (now {t.key[b]!r} for {t.ntok[b]})"
            )
        if t == s:
            return None
        if not _held(s, b):
            return f"block {b} (ref {s.ref[b]}) was cached without being held"
        if not replace and t.ntok[b] < s.ntok[b]:
            return f"block {b}'s key went backwards: {s.key[b]!r} for {s.ntok[b]} -> {t.key[b]!r} for {t.ntok[b]}"
        after = {k for k, _ in pool.keys_of(t, b)}
        if after != (before | {key} if keep else {key}):
            return f"block {b}'s keys went {sorted(map(str, before))} -> {sorted(map(str, after))} caching {key!r} (keep {keep})"
        return None
    if op == "move_key":
        src, dst = args
        if not (_held(s, src) and _held(s, dst)):
            return f"a key moved between blocks not both held: {src} (ref {s.ref[src]}) -> {dst} (ref {s.ref[dst]})"
    return None


def _compute_choice_broken(s: PoolState, taken: tuple[int, ...]) -> Optional[str]:
    """The compute policy's rule, stated pairwise: no cached block is taken while an uncached
    free block is left, and no cached block taken outranks one left (lower priority, or equal
    and released earlier: earlier in the queue)."""
    left = [b for b in s.free if b not in taken]
    cached_taken = [b for b in taken if s.key[b] is not None]
    if cached_taken and any(s.key[b] is None for b in left):
        return f"evicted {cached_taken} while uncached {[b for b in left if s.key[b] is None]} were free"
    position = {b: i for i, b in enumerate(s.free)}
    for x in cached_taken:
        for y in left:
            if s.key[y] is not None and (s.prio[y], position[y]) < (s.prio[x], position[x]):
                return f"evicted block {x} (priority {s.prio[x]}) but kept block {y} (priority {s.prio[y]}, released before it or cheaper)"
    return None


@dataclass
class Search:
    """Breadth-first search state: where each state was first reached from, and what was seen."""

    parent: dict[PoolState, tuple[Optional[PoolState], Optional[Call]]]
    accepted: Counter
    refused: Counter

    def path(self, s: PoolState) -> list[str]:
        steps = []
        while self.parent[s][1] is not None:
            s, call = self.parent[s]
            steps.append(str(call))
        return steps[::-1]


def _describe(search: Search, s: PoolState, call: Call, what: str) -> str:
    steps = [f"initial({s.num_blocks})", *search.path(s), str(call)]
    return f"{'; '.join(steps)}: {what}"


def check_sequences(ops: Ops, budget: float, scopes: tuple[tuple[int, int], ...] = SCOPES, policy: str = LRU) -> Outcome:
    """For each (num_blocks, depth) of ``scopes``: every sequence of at most ``depth`` calls from
    ``initial(num_blocks, policy)``, run with ``ops``."""
    deadline = time.monotonic() + budget
    done = []
    for num_blocks, depth in scopes:
        outcome = _search(ops, num_blocks, depth, deadline, policy)
        if outcome.verdict == INCOMPLETE:
            return Outcome(INCOMPLETE, detail="; ".join(done + [outcome.detail]))
        if outcome.verdict != CHECKED:
            return outcome
        done.append(outcome.detail)
    return Outcome(CHECKED, detail="; ".join(done) + "; every contract and rule held")


def _search(ops: Ops, num_blocks: int, depth: int, deadline: float, policy: str = LRU) -> Outcome:
    start = pool.initial(num_blocks, policy)
    search = Search(parent={start: (None, None)}, accepted=Counter(), refused=Counter())
    frontier, calls = [start], 0
    for _ in range(depth):
        next_frontier = []
        for s in frontier:
            if time.monotonic() > deadline:
                return Outcome(
                    INCOMPLETE,
                    detail=f"{num_blocks} blocks: budget spent after {len(search.parent):,} states, {calls:,} calls",
                )
            for call in moves(s):
                calls += 1
                try:
                    result = ops[call.op](s, *call.args)
                except ValueError as e:
                    if not _refused_by_a_precondition(e):
                        what = f"ValueError from the body: {e}"
                        return Outcome(REFUTED, counterexample=_describe(search, s, call, what))
                    search.refused[call.op] += 1
                    continue
                except icontract.ViolationError as e:
                    return Outcome(REFUTED, counterexample=_describe(search, s, call, violation_summary(e)))
                except Exception as e:  # a crash on an input every precondition accepted
                    return Outcome(REFUTED, counterexample=_describe(search, s, call, f"{type(e).__name__}: {e}"))
                t = _next_state(call, result)
                bad = transition_fact_broken(call, s, result, t)
                if bad is None and t is not None and not pool.well_formed(t):
                    bad = "the new state is not well formed"
                if bad is not None:
                    return Outcome(REFUTED, counterexample=_describe(search, s, call, bad))
                search.accepted[call.op] += 1
                if t is not None and t not in search.parent:
                    search.parent[t] = (s, call)
                    next_frontier.append(t)
        frontier = next_frontier
    unexercised = sorted(set(ops) - set(search.accepted))
    if unexercised:
        return Outcome(ERROR, detail=f"{num_blocks} blocks: no call of {', '.join(unexercised)} was ever accepted")
    return Outcome(
        CHECKED,
        detail=f"{num_blocks} blocks: {len(search.parent):,} states within {depth} calls, {calls:,} calls "
        f"({sum(search.refused.values()):,} refused as bad input)",
    )


def _cache_partial_accepting_outgrown(
    s: PoolState, block: int, key, num_tokens: int, replace: bool = False, keep_prefixes: bool = False
) -> tuple[PoolState, Optional[bool]]:
    """SEEDED BUG (vLLM 0.33's alias, docs/vllm-semantics.md §10.2): a partial boundary the block
    has already outgrown is attached instead of refused, so the block is named by a prefix shorter
    than the one it holds (for a Mamba state: a stale state served as a hit)."""
    if s.key[block] == key:
        return s, False
    attached = (
        s.key[:block] + (key,) + s.key[block + 1 :],
        s.ntok[:block] + (num_tokens,) + s.ntok[block + 1 :],
        s.stamp[:block] + (s.clock,) + s.stamp[block + 1 :],
    )
    return dataclasses.replace(s, key=attached[0], ntok=attached[1], stamp=attached[2], clock=s.clock + 1), True


#: The spec's operations with the seeded ``cache_partial``, under the real one's contracts.
STALE_PARTIAL_OPS: Ops = {
    **SPEC_OPS, "cache_partial": guard_like(pool.cache_partial, _cache_partial_accepting_outgrown)
}

def _allocate_ignoring_priority(s: PoolState, n: int):
    """SEEDED BUG: the compute policy takes the free queue's head (LRU order) whatever the
    priorities say."""
    result = pool.allocate(dataclasses.replace(s, policy=LRU), n)
    return None if result is None else (dataclasses.replace(result[0], policy=s.policy), result[1])


#: The spec's operations with an allocate that ignores the compute policy's priorities.
IGNORED_PRIORITY_OPS: Ops = {**SPEC_OPS, "allocate": guard_like(pool.allocate, _allocate_ignoring_priority)}

EVICTION_INVARIANTS = ("INV-EVICT-UNCACHED-FIRST", "INV-EVICT-MIN", "INV-EVICT-CLOCK", "INV-EVICT-VALUE")

OBLIGATIONS = (
    Obligation(
        "EXH-POOL-EVICTION",
        EVICTION_INVARIANTS + INVARIANTS,
        "exhaustive",
        "under the compute policy every sequence of <= 5 pool operations on 3 blocks, releases valued from a menu, "
        "keeps the pool well formed with every contract holding, and allocate takes uncached blocks first and "
        "then the lowest priorities",
        lambda budget: check_sequences(SPEC_OPS, budget, COMPUTE_SCOPES, COMPUTE),
    ),
    Obligation(
        "CANARY-EVICT-IGNORES-PRIORITY",
        ("INV-EVICT-MIN",),
        "exhaustive",
        "a compute-policy allocate that takes the queue's head (LRU order) is caught",
        lambda budget: check_sequences(IGNORED_PRIORITY_OPS, budget, COMPUTE_SCOPES, COMPUTE),
    ),
    Obligation(
        "EXH-POOL-SEQUENCES",
        INVARIANTS,
        "exhaustive",
        "every sequence of <= 6 pool operations on 3 blocks (<= 4 on 4 blocks) keeps the pool well formed, "
        "every contract holding",
        lambda budget: check_sequences(SPEC_OPS, budget),
    ),
    Obligation(
        "CANARY-POOL-STALE-PARTIAL",
        ("INV-POOL-NO-STALE-PARTIAL",),
        "exhaustive",
        "a cache_partial that accepts a boundary the block has outgrown (vLLM 0.33's alias) is caught",
        lambda budget: check_sequences(STALE_PARTIAL_OPS, budget),
    ),
)
