"""Each block-pool contract can fire, and its violation names its invariant id.

Three ways to make a contract fire:
* bad input: the cheap tier (plain code, always on) raises ValueError starting with the id;
* corrupted state: ``_check()`` (slow tier) raises InvariantViolation with the id;
* seeded bugs: the pool's modules (impl/block_pool.py and its parts) are loaded afresh with one
  line of one of them mutated and the slow tier forced on (or off, for the cheap-tier
  postconditions, which must catch the bug alone), and the icontract postcondition carrying the
  id must catch the bug. The mutated line must exist exactly once among them, so a refactor
  that removes it makes the test fail instead of passing vacuously. The sources are the modules
  as imported (``inspect.getsource``), so a changed contract line -- what tools/mutation.py
  makes -- is what the seeded bug meets.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import pathlib
import re
import sys
import tempfile

import icontract
import pytest

import kvproof.impl.block_pool as block_pool_module
from kvproof.spec import contracts
from kvproof.spec.contracts import InvariantViolation

#: The pool and its parts, each after the ones it imports.
PARTS = ("free_list", "key_index", "eviction_queue", "block_pool")
SOURCES = {part: inspect.getsource(importlib.import_module(f"kvproof.impl.{part}")) for part in PARTS}
_fresh = itertools.count()
_MUTANT_DIR = pathlib.Path(tempfile.mkdtemp(prefix="kvproof-mutants-"))


def pool_module(monkeypatch, mutate: tuple[str, str] | None = None, slow: bool = True):
    """impl/block_pool.py and its parts loaded afresh with the slow switch set to ``slow``,
    optionally with one source fragment replaced (it must occur exactly once among them);
    returns the fresh block_pool module."""
    sources = dict(SOURCES)
    if mutate is not None:
        old, new = mutate
        found = [part for part, source in sources.items() for _ in range(source.count(old))]
        assert len(found) == 1, f"mutation target not found exactly once: {old!r} ({found})"
        sources[found[0]] = sources[found[0]].replace(old, new)
    monkeypatch.setattr(contracts, "_slow", slow)
    serial = next(_fresh)
    for part in PARTS:
        # A real file, because icontract reads the conditions' source to word its violations.
        path = _MUTANT_DIR / f"kvproof_{part}_mutant_{serial}.py"
        path.write_text(sources[part])
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        # The next part's ``from kvproof.impl.<part> import ...`` gets this copy.
        monkeypatch.setitem(sys.modules, f"kvproof.impl.{part}", module)
        spec.loader.exec_module(module)
    return module


def violation(exc_info) -> str:
    return str(exc_info.value)


# --- seeded bugs caught by the icontract (slow-tier) postconditions -------------------------------

SEEDED_BUGS = {
    "INV-POOL-ATOMIC": (
        ("        if n > self._num_free:\n            return None", "        if n > self._num_free:\n            self.allocate(1)\n            return None"),
        lambda pool: (pool.allocate(1), pool.allocate(5)),
    ),
    "INV-POOL-ALLOC-FRESH": (
        ("                self._index.drop(b)\n                self.num_evictions += 1\n", "                self.num_evictions += 1\n"),
        lambda pool: (pool.allocate(1), pool.cache_full(1, ("k", 0), 2), pool.free([1]), pool.allocate(3)),
    ),
    "INV-POOL-REF-NONNEG: touch adds one reference": (
        ("            ref[b] += 1\n", "            ref[b] += 2\n"),
        lambda pool: (pool.allocate(1), pool.touch([1])),
    ),
    "INV-POOL-REF-NONNEG: free drops one reference": (
        ("            r = ref[b] - 1\n", "            r = ref[b] - 1 if ref[b] > 1 else 1\n"),
        lambda pool: (pool.allocate(1), pool.free([1])),
    ),
    "INV-POOL-NO-STALE-PARTIAL: cache_partial refuses exactly": (
        ("            if index.ntok[block] >= num_tokens:\n                return None\n", ""),
        lambda pool: (pool.allocate(1), pool.cache_full(1, ("k12", 0), 12), pool.cache_partial(1, ("k10", 0), 10)),
    ),
    "INV-POOL-NO-STALE-PARTIAL: after cache_full": (
        ("        index.attach(block, key, num_tokens, holders)\n        return True\n\n    def _offer_partial",
         "        index.attach(block, key, num_tokens + 1, holders)\n        return True\n\n    def _offer_partial"),
        lambda pool: (pool.allocate(1), pool.cache_full(1, ("k", 0), 4)),
    ),
    "INV-POOL-PREFIX-KEYS: evicted blocks have no key": (
        ("            if self._index.key[b] is not None:\n                self._index.drop(b)\n                dropped += 1\n"
         "                if self._ref[b] == 0:  # a free block that no longer caches anything\n"
         "                    self._occupied[self._group[b]] -= 1\n"
         "                    self._queue.uncache(b)\n", "            pass\n"),
        lambda pool: (pool.allocate(1), pool.cache_full(1, ("k", 0), 2), pool.evict([1])),
    ),
    "INV-POOL-PREFIX-KEYS: extend_partial keeps every key the block had": (
        ('self._offer_partial(block, key, num_tokens, self._index.demote, "extend_partial")',
         'self._offer_partial(block, key, num_tokens, self._index.drop, "extend_partial")'),
        lambda pool: (pool.allocate(1), pool.extend_partial(1, ("k2", 0), 2),
                      pool.extend_partial(1, ("k4", 0), 4)),
    ),
    "INV-POOL-PREFIX-KEYS: grow_keys keeps every key the block had": (
        ("        if index.key[block] is not None:\n            index.demote(block)\n",
         "        if index.key[block] is not None:\n            index.drop(block)\n"),
        lambda pool: (pool.allocate(1), pool.extend_partial(1, ("k2", 0), 2),
                      pool.grow_keys(1, [(("k4", 0), 4), (("k6", 0), 6)])),
    ),
    "INV-POOL-PREFIX-KEYS: extend_full keeps every key the block had": (
        ('self._attach_full(block, key, num_tokens, self._index.demote, "extend_full")',
         'self._attach_full(block, key, num_tokens, self._index.drop, "extend_full")'),
        lambda pool: (pool.allocate(1), pool.extend_partial(1, ("k2", 0), 2), pool.extend_full(1, ("k4", 0), 4)),
    ),
    "INV-POOL-NO-STALE-PARTIAL: after replace_key": (
        ("        if self._index.key[block] is not None:\n            self._index.drop(block)\n",
         "        if self._index.key[block] is not None:\n            self._index.demote(block)\n"),
        lambda pool: (pool.allocate(1), pool.cache_partial(1, ("k2", 0), 2), pool.replace_key(1, ("k4", 0), 4)),
    ),
    "INV-POOL-RESET-IDLE": (
        ("        if self._num_free != self._num_blocks - 1:\n            return False\n", ""),
        lambda pool: (pool.allocate(1), pool.reset()),
    ),
    "INV-POOL-KEY-CONSISTENT: a successful reset drops every key": (
        ("        self.holders.clear()\n", ""),
        lambda pool: (pool.allocate(1), pool.cache_full(1, ("k", 0), 2), pool.free([1]), pool.reset()),
    ),
    "INV-POOL-KEY-CONSISTENT: the keys moved": (
        ("        self.key[src], self.ntok[src] = None, 0\n", ""),
        lambda pool: (pool.allocate(2), pool.cache_full(1, ("k", 0), 2), pool.move_key(1, 2)),
    ),
}


@pytest.mark.parametrize("label", sorted(SEEDED_BUGS))
def test_seeded_bug_is_caught_by_its_contract(monkeypatch, label):
    """The label is the contract expected to fire; where the whole-pool check (run by the same
    call's postconditions) sees the damage first, it must report the same invariant id."""
    mutation, drive = SEEDED_BUGS[label]
    pool = pool_module(monkeypatch, mutation).BlockPool(4)
    with pytest.raises((icontract.ViolationError, InvariantViolation)) as exc_info:
        drive(pool)
    assert label.split(":")[0] in violation(exc_info), violation(exc_info)


def test_unmutated_module_passes_the_same_drives(monkeypatch):
    """Control: the drives above are legal sequences, so only the seeded bug can make them fail."""
    for _, drive in SEEDED_BUGS.values():
        drive(pool_module(monkeypatch).BlockPool(4))


# The cheap-tier postconditions (``tier=CHEAP``) stay on with the slow switch off, so with
# it off each must catch its seeded bug by itself (no whole-pool check runs to help).
def _prefixed(pool):
    """Blocks 1 and 2 held; block 1 keyed at 4 tokens with a prefix key at 2."""
    pool.allocate(2)
    pool.extend_partial(1, ("k2", 0), 2)
    pool.extend_full(1, ("k4", 0), 4)


CHEAP_BUGS = {
    "src keeps its key": (
        "INV-POOL-KEY-CONSISTENT: the keys moved",
        ("        self.key[src], self.ntok[src] = None, 0\n", ""),
        lambda pool: (pool.allocate(2), pool.cache_full(1, ("k", 0), 2), pool.move_key(1, 2)),
    ),
    "dst gets no key": (
        "INV-POOL-KEY-CONSISTENT: the keys moved",
        ("        self.key[dst], self.ntok[dst] = self.key[src], self.ntok[src]\n", ""),
        lambda pool: (pool.allocate(2), pool.cache_full(1, ("k", 0), 2), pool.move_key(1, 2)),
    ),
    "src keeps its prefix keys": (
        "INV-POOL-KEY-CONSISTENT: the keys moved",
        ("        moved = self.prefixes.pop(src, None)\n", "        moved = self.prefixes.get(src)\n"),
        lambda pool: (_prefixed(pool), pool.move_key(1, 2)),
    ),
    "evict keeps a prefix key": (
        "INV-POOL-PREFIX-KEYS: evicted blocks have no key",
        ("        extra = self.prefixes.pop(block, None)\n", "        extra = self.prefixes.get(block)\n"),
        lambda pool: (_prefixed(pool), pool.evict([1])),
    ),
    "reset of a busy pool": (
        "INV-POOL-RESET-IDLE: reset succeeds exactly when no real block is in use",
        ("        if self._num_free != self._num_blocks - 1:\n            return False\n", ""),
        lambda pool: (pool.allocate(1), pool.reset()),
    ),
    "reset keeps the key map": (
        "INV-POOL-KEY-CONSISTENT: a successful reset drops every key",
        ("        self.holders.clear()\n", ""),
        lambda pool: (pool.allocate(1), pool.cache_full(1, ("k", 0), 2), pool.free([1]), pool.reset()),
    ),
}


@pytest.mark.parametrize("bug", sorted(CHEAP_BUGS))
def test_a_cheap_postcondition_catches_its_seeded_bug_with_the_slow_switch_off(monkeypatch, bug):
    description, mutation, drive = CHEAP_BUGS[bug]
    pool = pool_module(monkeypatch, mutation, slow=False).BlockPool(4)
    with pytest.raises(icontract.ViolationError) as exc_info:
        drive(pool)
    assert description in violation(exc_info), violation(exc_info)


def test_unmutated_module_passes_the_cheap_drives_with_the_slow_switch_off(monkeypatch):
    for _, _, drive in CHEAP_BUGS.values():
        drive(pool_module(monkeypatch, slow=False).BlockPool(4))


def test_slow_tier_whole_pool_check_runs_after_each_verb(monkeypatch):
    """With SLOW on, a corruption is caught by the next verb's whole-pool postcondition."""
    pool = pool_module(monkeypatch).BlockPool(4)
    pool.allocate(1)
    pool._ref[3] = 1  # block 3 is referenced but still in the free queue
    with pytest.raises(InvariantViolation, match=r"INV-POOL-FREE-IFF-UNREF: block 3 has ref count 1 but in free queue: True"):
        pool.allocate(1)


# --- corrupted state caught by _check() (slow tier) -----------------------------------------------


def corrupted(corrupt):
    pool = block_pool_module.BlockPool(5)
    pool.allocate(3)
    pool.cache_full(1, ("k", 0), 4)
    pool.cache_partial(2, ("p", 0), 2)
    assert pool._check()
    corrupt(pool)
    return pool


def _list_a_block_under_a_key_it_does_not_carry(pool):
    pool._index.holders[("p", 0)].append(1)


def _give_a_block_a_prefix_key_longer_than_its_primary(pool):
    pool._index.prefixes[1] = [(("q", 0), 9)]
    pool._index.holders[("q", 0)] = [1]


def _list_a_block_twice_under_a_key_and_drop_another(pool):
    """The counts still agree (k listed twice, p not at all): only the duplicate shows it."""
    pool._index.holders[("k", 0)] = [1, 1]
    del pool._index.holders[("p", 0)]


def _give_a_block_a_prefix_key_of_no_tokens(pool):
    pool._index.prefixes[1] = [(("q", 0), 0)]
    pool._index.holders[("q", 0)] = [1]


CORRUPTIONS = {
    "INV-POOL-CONSERVE": lambda pool: pool._ref.append(0),
    "INV-POOL-NULL": lambda pool: pool._ref.__setitem__(0, 1),
    "INV-POOL-REF-NONNEG": lambda pool: pool._ref.__setitem__(3, -1),
    "INV-POOL-FREE-IFF-UNREF": lambda pool: pool._ref.__setitem__(3, 0),
    "INV-POOL-FREE-IFF-UNREF (queue links)": lambda pool: pool._queue._list.next.__setitem__(pool._queue._list.head, 2),
    "INV-POOL-FREE-IFF-UNREF (links of a held block)": lambda pool: pool._queue._list.prev.__setitem__(3, 4),
    "INV-POOL-CONSERVE (free counter)": lambda pool: setattr(pool, "_num_free", 2),
    "INV-POOL-KEY-CONSISTENT": lambda pool: pool._index.ntok.__setitem__(3, 7),
    "INV-POOL-KEY-LENGTH": lambda pool: (pool._index.holders[("k", 0)].append(3), pool._index.key.__setitem__(3, ("k", 0)),
                                          pool._index.ntok.__setitem__(3, 6)),
    "INV-POOL-KEY-CONSISTENT (a key lists a block that does not carry it)": _list_a_block_under_a_key_it_does_not_carry,
    "INV-POOL-PREFIX-KEYS": _give_a_block_a_prefix_key_longer_than_its_primary,
    "INV-POOL-PREFIX-KEYS (a prefix of no tokens)": _give_a_block_a_prefix_key_of_no_tokens,
    "INV-POOL-KEY-CONSISTENT (a key with no holder)": lambda pool: pool._index.holders.__setitem__(("ghost", 0), []),
    "INV-POOL-KEY-CONSISTENT (a holder listed twice)": _list_a_block_twice_under_a_key_and_drop_another,
}


@pytest.mark.parametrize("label", sorted(CORRUPTIONS))
def test_check_names_the_broken_invariant(label):
    pool = corrupted(CORRUPTIONS[label])
    with pytest.raises(InvariantViolation) as exc_info:
        pool._check()
    assert exc_info.value.inv_id == label.split(" ")[0], violation(exc_info)


@pytest.mark.parametrize("target", ["null", "head"])
def test_check_names_a_free_queue_that_runs_into_a_sentinel_or_the_null_block(target):
    """The queue walk stops at the first id that is not a real block -- the null block 0, or the
    head sentinel ``num_blocks`` (a queue closed into a ring) -- and names it."""
    pool = block_pool_module.BlockPool(4)  # queue: head -> 1 -> 2 -> 3 -> tail
    queue = pool._queue._list
    bad = 0 if target == "null" else queue.head
    queue.next[2] = bad
    with pytest.raises(InvariantViolation, match=re.escape(f"free queue reaches id {bad} after 2 blocks")):
        pool._check()
    assert len(pool.free_order()) == pool.num_blocks  # the debugging walk stops after num_blocks steps


def test_allocate_catches_a_referenced_block_in_the_free_queue_cheaply():
    """Cheap tier, always on: popping a block whose ref count is not 0 is an InvariantViolation."""
    pool = block_pool_module.BlockPool(3)
    pool._ref[1] = 2
    with pytest.raises(InvariantViolation, match=r"INV-POOL-FREE-IFF-UNREF: block 1 popped from the free queue has ref count 2"):
        pool.allocate(1)


# --- bad input caught by the cheap tier (always on) ------------------------------------------------

BAD_INPUT = {
    "INV-POOL-NULL": lambda pool: pool.cache_partial(0, ("k", 0), 2),
    "INV-POOL-REF-NONNEG": lambda pool: pool.free([3]),
    "INV-POOL-FREE-IFF-UNREF": lambda pool: pool.touch([3]),
    "INV-POOL-HELD-TO-CACHE": lambda pool: pool.cache_full(3, ("k", 0), 2),
    "INV-POOL-KEY-LENGTH": lambda pool: pool.cache_full(2, ("k", 0), 8),
    "INV-POOL-NO-STALE-PARTIAL": lambda pool: pool.cache_full(1, ("short", 0), 2),
    # grow_keys: a covered boundary, and a key of another length, refused before any change
    "INV-POOL-NO-STALE-PARTIAL (grow_keys)": lambda pool: pool.grow_keys(2, [(("a", 0), 2), (("b", 0), 2)]),
    "INV-POOL-KEY-LENGTH (grow_keys)": lambda pool: pool.grow_keys(2, [(("a", 0), 2), (("k", 0), 6)]),
    "INV-POOL-HELD-TO-CACHE (grow_keys)": lambda pool: pool.grow_keys(3, [(("a", 0), 2)]),
    # the other verbs share cache_full's and cache_partial's checks
    "INV-POOL-NO-STALE-PARTIAL (extend_full)": lambda pool: pool.extend_full(1, ("short", 0), 2),
    "INV-POOL-KEY-LENGTH (extend_partial)": lambda pool: pool.extend_partial(2, ("k", 0), 8),
    "INV-POOL-HELD-TO-CACHE (replace_key)": lambda pool: pool.replace_key(3, ("k", 0), 4),
}


@pytest.mark.parametrize("inv_id", sorted(BAD_INPUT))
def test_bad_input_names_the_invariant_and_changes_nothing(inv_id):
    pool = block_pool_module.BlockPool(4)
    pool.allocate(2)
    pool.cache_full(1, ("k", 0), 4)
    keys = pool._index
    before = (list(pool._ref), list(keys.key), list(keys.ntok), pool.free_order())
    with pytest.raises(ValueError, match=rf"^{inv_id.split()[0]}: "):
        BAD_INPUT[inv_id](pool)
    assert (list(pool._ref), list(keys.key), list(keys.ntok), pool.free_order()) == before
    assert not keys.prefixes and pool.num_cached_keys() == 1
