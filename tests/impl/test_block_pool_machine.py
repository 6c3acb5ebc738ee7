"""Differential state machine: impl.block_pool.BlockPool against spec.block_pool, plus a content oracle.

Every rule runs the same call on the implementation and on the pure spec model and compares the
outcome (result or ValueError); the invariants compare every observable after every step.

The content oracle models what each block really holds: when a cache call attaches key
``K(N, g)`` of prefix ``p`` to block b, the "caller" has just written ``p[:N]`` of group g into b.
Every holder of every key must hold exactly the prefix the key names (salt, tokens, group), so a
stale key (vLLM 0.33's alias after promotion), a key surviving reallocation, or two cache salts
sharing a block all show up as a content mismatch.

Inputs are valid by construction where that matters (boundaries are multiples of H within the
prefix); blocks come from a Bundle and may be stale, in which case both sides must reject.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Optional

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.hashing import key_at, request_block_hashes
from kvproof.spec.arith import cdiv
from kvproof.spec import block_pool as spec
from kvproof.spec.eviction import COMPUTE, POLICIES, victims
from ..conftest import PROFILE, Reach

#: What the fixed-seed run must reach (checked after the last example).
REACH = Reach()
#: Values a release gives its blocks under the compute policy: equal ones (ties broken by
#: release order) and different ones, some worth many releases (so later blocks overtake).
VALUES = st.sampled_from([0.0, 1.0, 2.5, 10.0])

H = 2  # hash-block size: small so prefixes share and diverge often
GROUPS = (0, 1)
SALTS = (None, "tenant-a", "tenant-b")


class Prefix(NamedTuple):
    salt: Optional[str]
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]


def _prefix(salt: Optional[str], tokens: tuple[int, ...]) -> Prefix:
    return Prefix(salt, tokens, tuple(request_block_hashes(list(tokens), H, cache_salt=salt)))


def _outcome(call):
    """('ok', result) or ('ValueError', None): failed calls are compared by exception type."""
    try:
        return "ok", call()
    except ValueError:
        return "ValueError", None


#: The caching calls the machine makes: full or partial keys, a rewritten state (replace), or
#: append-only growth that keeps the block's older keys as prefix keys (keep).
CACHE_KINDS = ["full", "full keep", "partial", "partial keep", "replace"]


def _pool_verb(pool: BlockPool, full: bool, keep: bool, replace: bool):
    """The pool verb for a caching call the spec makes with flags (one verb per intent)."""
    if replace:
        return pool.replace_key
    if full:
        return pool.extend_full if keep else pool.cache_full
    return pool.extend_partial if keep else pool.cache_partial


tokens_strategy = st.lists(st.integers(0, 2), min_size=H, max_size=4 * H).map(lambda t: tuple(t[: len(t) - len(t) % H]))


class CacheKey(NamedTuple):
    key: tuple[bytes, int]
    num_tokens: int
    names: tuple  # (salt, tokens, group): the content a block holding this key must have


class Request:
    """A running request of the minimal manager: its prefix, group, block size and blocks."""

    def __init__(self, prefix: Prefix, group: int, block_tokens: int, blocks: list[int], keep: bool,
                 every_hash: bool = False) -> None:
        self.prefix, self.group, self.block_tokens, self.blocks = prefix, group, block_tokens, blocks
        #: Append-only contents (attention): growing a block keeps its older keys as prefix keys.
        self.keep = keep
        #: With keep: key every hash boundary written, in one ``grow_keys`` call per block.
        self.every_hash = keep and every_hash


class PoolMachine(RuleBasedStateMachine):
    prefixes = Bundle("prefixes")
    keys = Bundle("keys")
    blocks = Bundle("blocks")

    @initialize(num_blocks=st.integers(2, 8), policy=st.sampled_from(POLICIES))
    def start(self, num_blocks, policy):
        self.pool = BlockPool(num_blocks, policy=policy)
        self.model = spec.initial(num_blocks, policy)
        self.policy = policy
        self.held: list[int] = []  # the references the test (as caller) holds, one entry each
        self.content: dict[int, Optional[tuple]] = {}  # block -> (salt, tokens, group) it holds
        self.keys_seen: dict[tuple, tuple] = {}  # key -> the content it names
        self.requests: list[Request] = []
        self.fresh = 0  # salts handed out by _key_fresh

    # --- prefixes ------------------------------------------------------------------------------

    @initialize(target=prefixes, tokens=tokens_strategy, more=tokens_strategy, salt=st.sampled_from(SALTS[1:]))
    def seed_prefixes(self, tokens, more, salt):
        """Prefixes that share a chain (a base and its extension) and the same tokens under a salt."""
        return multiple(_prefix(None, tokens), _prefix(None, tokens + more), _prefix(salt, tokens))

    @rule(target=prefixes, salt=st.sampled_from(SALTS), tokens=tokens_strategy)
    def new_prefix(self, salt, tokens):
        return _prefix(salt, tokens)

    @rule(target=prefixes, base=prefixes, more=tokens_strategy)
    def extend_prefix(self, base, more):
        return _prefix(base.salt, (base.tokens + more)[: 6 * H])

    @rule(target=keys, prefix=prefixes, k=st.integers(0, 7), group=st.sampled_from(GROUPS))
    def new_key(self, prefix, k, group):
        """A key K(N, g) of the prefix, N a multiple of H within it (valid by construction)."""
        n = H * (1 + k % len(prefix.hashes))
        key = key_at(prefix.hashes, n, H, group)
        named = (prefix.salt, prefix.tokens[:n], group)
        self.keys_seen[key] = named
        return CacheKey(key, n, named)

    # --- verbs ---------------------------------------------------------------------------------

    def _values(self, data, blocks):
        """Values for a release: drawn under compute (or none at all), None under lru."""
        if self.policy != COMPUTE or not data.draw(st.integers(0, 3)):
            return None
        return data.draw(st.lists(VALUES, min_size=len(blocks), max_size=len(blocks)))

    def _label_eviction(self, taken):
        """Label what an allocate under compute did: evicted cached blocks, with an uncached block
        or a cheaper-but-later cached block it had to pass over."""
        if self.policy != COMPUTE:
            return
        m = self.model
        cached = [b for b in taken if m.key[b] is not None]
        if not cached:
            return
        REACH("compute: evicted a cached block")
        if any(m.key[b] is None for b in taken):
            REACH("compute: uncached taken before cached")
        order = [b for b in m.free if m.key[b] is not None]
        if order and cached[0] != order[0]:
            REACH("compute: evicted out of release order")

    def _allocate(self, n) -> list[int]:
        """Allocate ``n`` blocks on both sides (none if too few are free); the caller holds them."""
        got = self.pool.allocate(n)
        expected = spec.allocate(self.model, n)
        if expected is None:
            assert got is None
            return []
        self._label_eviction(expected[1])
        self.model, taken = expected
        assert tuple(got) == taken, "allocate order differs from the spec"
        for b in got:
            self.held.append(b)
            self.content[b] = None  # fresh block: garbage until written
        return list(got)

    @rule(target=blocks, n=st.integers(0, 4))
    def allocate(self, n):
        return multiple(*self._allocate(n))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_held(self, data):
        picks = data.draw(st.lists(st.integers(0, len(self.held) - 1), unique=True, min_size=1, max_size=4))
        chosen = [self.held[i] for i in picks]
        values = self._values(data, chosen)
        self.pool.free(chosen, values)
        self.model = spec.free(self.model, chosen, values)
        for i in sorted(picks, reverse=True):
            del self.held[i]

    @precondition(lambda self: self.policy == COMPUTE and len(self.held) >= 2)
    @rule(data=st.data())
    def free_valuable_then_cheap(self, data):
        """The compute policy's hard case: a valuable block released before a cheap one, so the
        later one goes first."""
        picks = data.draw(st.lists(st.integers(0, len(self.held) - 1), unique=True, min_size=2, max_size=2))
        chosen = [self.held[i] for i in picks]
        values = [data.draw(st.sampled_from([2.5, 10.0])), 0.0]
        self.pool.free(chosen, values)
        self.model = spec.free(self.model, chosen, values)
        for i in sorted(picks, reverse=True):
            del self.held[i]

    def _sole_held(self) -> list[int]:
        """Held blocks whose one reference is the test's: freeing them releases them."""
        return [b for b in dict.fromkeys(self.held) if self.model.ref[b] == 1]

    def _key_fresh(self, block: int) -> None:
        """Cache a key no other block holds (a salt of its own) on a held uncached block."""
        self.fresh += 1
        p = _prefix(f"fresh-{self.fresh}", (0,) * H)
        key, named = key_at(p.hashes, H, H, 0), (p.salt, p.tokens, 0)
        self.keys_seen[key] = named
        assert self._cache_both(block, key, H, full=True, keep=False) is True
        self.content[block] = named

    @precondition(lambda self: self.policy == COMPUTE and len(self._sole_held()) >= 2)
    @rule(target=blocks, data=st.data(), value=st.sampled_from([2.5, 10.0]))
    def evict_past_valuable(self, data, value):
        """The compute policy's hard case end to end, on a full pool: take every free block,
        release a valuable cached block and then a cheap one (and maybe an uncached one), and
        allocate one block past the uncached: the cheap later one must go first (INV-EVICT-MIN,
        INV-EVICT-UNCACHED-FIRST), the valuable one stays."""
        valuable, cheap = data.draw(st.permutations(self._sole_held()))[:2]
        for b in (valuable, cheap):
            if self.model.key[b] is None:
                self._key_fresh(b)
        drained = self._allocate(len(self.model.free))
        released = [valuable, cheap] + ([drained.pop()] if drained and data.draw(st.booleans()) else [])
        for b in released:
            self.held.remove(b)
        values = [value, 0.0, 0.0][: len(released)]
        self.pool.free(released, values)
        self.model = spec.free(self.model, released, values)
        return multiple(*drained, *self._allocate(len(released) - 1))

    @rule(block=st.one_of(blocks, st.integers(-1, 9)))
    def free_any(self, block):
        got = _outcome(lambda: self.pool.free([block]))
        expected = _outcome(lambda: spec.free(self.model, [block]))
        assert got[0] == expected[0], (got, expected)
        if expected[0] == "ok":
            self.model = expected[1]
            if block != spec.NULL_BLOCK:
                self._forget_reference(block)

    @rule(ck=keys)
    def hit_and_touch(self, ck):
        found = self.pool.lookup(ck.key)
        assert found == spec.lookup(self.model, ck.key)
        event("lookup hit" if found is not None else "lookup miss")
        if found is None:
            return
        held = self.content.get(found)
        assert held is not None and held[::2] == ck.names[::2] and held[1][: len(ck.names[1])] == ck.names[1], (
            f"cache hit on block {found} returns {held}, not the prefix {ck.names}")
        self.pool.touch([found])
        self.model = spec.touch(self.model, [found])
        self.held.append(found)

    @rule(touched=st.lists(st.one_of(blocks, st.integers(-1, 9)), max_size=3))
    def touch_any(self, touched):
        got = _outcome(lambda: self.pool.touch(touched))
        expected = _outcome(lambda: spec.touch(self.model, touched))
        assert got[0] == expected[0], (touched, got, expected)
        if expected[0] == "ok":
            self.model = expected[1]
            self.held.extend(b for b in touched if b != spec.NULL_BLOCK)

    def _owned(self, *blocks) -> bool:
        """Whether a request owns one of ``blocks``: its manager alone keys them (the loose calls
        below exercise the pool API on every other block, stale and invalid ids included)."""
        if any(b in r.blocks for r in self.requests for b in blocks):
            event("a request's block left to its manager")
            return True
        return False

    def _cache(self, block, ck, kind):
        if self._owned(block):
            return
        key, n = ck.key, ck.num_tokens
        # A caller keeps older keys only when it appends: the new prefix continues the block's.
        keep = kind.endswith("keep") and self._continues(block, ck.names)
        full, replace = kind.startswith("full"), kind == "replace"
        got = _outcome(lambda: _pool_verb(self.pool, full, keep, replace)(block, key, n))
        if full:
            expected = _outcome(lambda: spec.cache_full(self.model, block, key, n, keep))
        else:
            expected = _outcome(lambda: spec.cache_partial(self.model, block, key, n, replace, keep))
        if expected[0] == "ok":
            self.model, result = expected[1]
            expected = ("ok", result)
            if result:  # newly attached: the caller wrote this prefix into the block
                self.content[block] = ck.names
        event(f"cache {kind}: {expected[0] if expected[0] != 'ok' else expected[1]}")
        assert got == expected, (kind, block, n, got, expected)

    def _continues(self, block, named) -> bool:
        """Whether ``named`` (salt, tokens, group) extends what ``block`` holds (or it holds nothing)."""
        old = self.content.get(block) if isinstance(block, int) else None
        return old is None or (old[0] == named[0] and old[2] == named[2] and named[1][: len(old[1])] == old[1])

    @precondition(lambda self: self.held)
    @rule(data=st.data(), ck=keys, kind=st.sampled_from(CACHE_KINDS))
    def cache_held(self, data, ck, kind):
        self._cache(data.draw(st.sampled_from(self.held)), ck, kind)

    @rule(block=st.one_of(blocks, st.integers(-1, 9)), ck=keys, kind=st.sampled_from(CACHE_KINDS))
    def cache_any(self, block, ck, kind):
        self._cache(block, ck, kind)

    @rule(block=st.one_of(blocks, st.integers(-1, 9)), cks=st.lists(keys, max_size=3))
    def grow_keys_any(self, block, cks):
        """``grow_keys`` with any block and keys: refused alike on both sides (stale or covered
        boundaries, lengths out of order, a key of another length); on success the keys name a
        chain of prefixes continuing the block's content, as an append-only writer's do."""
        if self._owned(block):
            return
        entries = [(ck.key, ck.num_tokens) for ck in cks]
        got = _outcome(lambda: self.pool.grow_keys(block, entries))
        expected = _outcome(lambda: spec.grow_keys(self.model, block, entries))
        assert got[0] == expected[0], (block, entries, got, expected)
        chain = all(self._continues(block, ck.names) for ck in cks) and all(
            b.names[::2] == a.names[::2] and b.names[1][: len(a.names[1])] == a.names[1] for a, b in zip(cks, cks[1:]))
        event(f"grow_keys any: {got[0]}{'' if chain or got[0] != 'ok' else ' (not a chain: undone)'}")
        if got[0] == "ok" and entries:
            if not chain:  # keys naming contents the block does not hold: out of this machine's scope
                self.pool.evict([block])
                self.model = spec.evict(expected[1], [block])
                self.content[block] = None
                return
            self.model = expected[1]
            self.content[block] = cks[-1].names

    @rule(evicted=st.lists(st.one_of(blocks, st.integers(-1, 9)), max_size=3))
    def evict(self, evicted):
        if self._owned(*evicted):
            return
        got = _outcome(lambda: self.pool.evict(evicted))
        expected = _outcome(lambda: spec.evict(self.model, evicted))
        assert got[0] == expected[0], (evicted, got, expected)
        if expected[0] == "ok":
            self.model = expected[1]

    @rule(src=blocks, dst=blocks)
    def move_key(self, src, dst):
        if self._owned(src, dst):
            return
        got = _outcome(lambda: self.pool.move_key(src, dst))
        expected = _outcome(lambda: spec.move_key(self.model, src, dst))
        assert got[0] == expected[0], (src, dst, got, expected)
        if expected[0] == "ok":
            self.model = expected[1]
            self.content[dst], self.content[src] = self.content.get(src), None  # src keeps being written

    @precondition(lambda self: self.held or self.requests)
    @rule()
    def free_everything(self):
        everything = list(reversed(self.held)) + [b for r in self.requests for b in reversed(r.blocks)]
        self.pool.free(everything)
        self.model = spec.free(self.model, everything)
        self.held.clear()
        self.requests.clear()

    @rule(data=st.data(), listed=st.lists(st.one_of(blocks, st.integers(-1, 9)), max_size=3))
    def requeue(self, data, listed):
        cached = [b for b in self.model.free if self.model.key[b] is not None]
        if cached:  # most often a block that is there to requeue
            listed = listed + data.draw(st.lists(st.sampled_from(cached), max_size=2))
        values = self._values(data, listed)
        got = _outcome(lambda: self.pool.requeue(listed, values))
        expected = _outcome(lambda: spec.requeue(self.model, listed, values))
        assert got[0] == expected[0], (listed, got, expected)
        if expected[0] == "ok":
            moved = sum(1 for b in dict.fromkeys(listed) if self.model.ref[b] == 0 and self.model.key[b] is not None)
            assert got[1] == moved
            if moved:
                REACH(f"{self.policy}: requeued a cached block")
            self.model = expected[1]

    def _cached_free(self) -> list[int]:
        return [b for b in self.model.free if self.model.key[b] is not None]

    @precondition(lambda self: self._cached_free())
    @rule(data=st.data())
    def requeue_cached(self, data):
        """Requeue evictable cached blocks (the case ``requeue`` exists for: a hit found them
        again), in any order, with values under compute."""
        listed = data.draw(st.lists(st.sampled_from(self._cached_free()), min_size=1, max_size=3))
        values = self._values(data, listed)
        got = self.pool.requeue(listed, values)
        expected = spec.requeue(self.model, listed, values)
        assert got == len(dict.fromkeys(listed)), (listed, got)
        REACH(f"{self.policy}: requeued a cached block")
        self.model = expected

    @rule()
    def reset(self):
        got = self.pool.reset()
        self.model, expected = spec.reset(self.model)
        assert got == expected

    # --- request-shaped sequences (a minimal manager: hits, prefill, growth, promotion) ----------

    def _lookup(self, key):
        found = self.pool.lookup(key)
        assert found == spec.lookup(self.model, key), key
        return found

    def _cache_both(self, block, key, n, full, keep):
        got = _pool_verb(self.pool, full, keep, replace=False)(block, key, n)
        if full:
            self.model, expected = spec.cache_full(self.model, block, key, n, keep)
        else:
            self.model, expected = spec.cache_partial(self.model, block, key, n, False, keep)
        assert got == expected, (block, n, full, got, expected)
        return got

    def _fill(self, req: "Request", start_block: int, old_tokens: int) -> None:
        """Cache the keys of blocks [start_block, ...) after the request's tokens grew from old_tokens."""
        p, g, bs = req.prefix, req.group, req.block_tokens
        n_tok = len(p.tokens)
        for j in range(start_block, len(req.blocks)):
            end = min((j + 1) * bs, n_tok)
            if end <= max(old_tokens, j * bs):
                continue
            if req.every_hash:
                self._grow_both(req, j, max(old_tokens, j * bs), end)
                continue
            key = key_at(p.hashes, end, H, g)
            named = (p.salt, p.tokens[:end], g)
            self.keys_seen[key] = named
            if self._cache_both(req.blocks[j], key, end, full=end == (j + 1) * bs, keep=req.keep):
                self.content[req.blocks[j]] = named

    def _grow_both(self, req: "Request", j: int, start: int, end: int) -> None:
        """Key every hash boundary in ``(start, end]`` of the request's block j in one call."""
        p, g, block = req.prefix, req.group, req.blocks[j]
        entries = []
        for n in range(start - start % H + H, end + 1, H):
            entries.append((key_at(p.hashes, n, H, g), n))
            self.keys_seen[entries[-1][0]] = (p.salt, p.tokens[:n], g)
        got = _outcome(lambda: self.pool.grow_keys(block, entries))
        expected = _outcome(lambda: spec.grow_keys(self.model, block, entries))
        assert got[0] == expected[0] == "ok", (block, entries, got, expected)
        self.model = expected[1]
        self.content[block] = (p.salt, p.tokens[:end], g)
        event(f"grow_keys: {len(entries)} keys")

    def _forget_reference(self, block: int) -> None:
        """A reference was dropped outside a request's lifecycle: take it from the loose holdings,
        else retire the request that owned it (its remaining blocks become loose references)."""
        if block in self.held:
            self.held.remove(block)
            return
        req = next(r for r in self.requests if block in r.blocks)
        self.requests.remove(req)
        req.blocks.remove(block)
        self.held.extend(req.blocks)

    @rule(prefix=prefixes, group=st.sampled_from(GROUPS), block_tokens=st.sampled_from([H, 2 * H, 4 * H]),
          keep=st.booleans(), every_hash=st.booleans())
    def prefill(self, prefix, group, block_tokens, keep, every_hash):
        """Admit a request: touch its longest chain of full-block hits, allocate the rest, cache."""
        n_tok, bs = len(prefix.tokens), block_tokens
        hits = []
        for j in range(n_tok // bs):
            b = self._lookup(key_at(prefix.hashes, (j + 1) * bs, H, group))
            if b is None:
                break
            held = self.content.get(b)
            want = (prefix.salt, prefix.tokens[: (j + 1) * bs], group)
            assert held is not None and held[::2] == want[::2] and held[1][: len(want[1])] == want[1], (
                f"hit block {b} holds {held}, not the prefix {want}")
            hits.append(b)
        event(f"prefill hits {len(hits)} blocks")
        self.pool.touch(hits)
        self.model = spec.touch(self.model, hits)
        need = cdiv(n_tok, bs) - len(hits)
        got = self.pool.allocate(need)
        expected = spec.allocate(self.model, need)
        if expected is not None:
            self._label_eviction(expected[1])
        if expected is None:
            assert got is None
            self.pool.free(hits[::-1])
            self.model = spec.free(self.model, hits[::-1])
            return
        self.model, taken = expected
        assert tuple(got) == taken
        for b in got:
            self.content[b] = None
        req = Request(prefix, group, bs, hits + got, keep, every_hash)
        self._fill(req, len(hits), len(hits) * bs)
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), more=tokens_strategy)
    def grow(self, data, more):
        """Append tokens to a running request: the tail entry grows forward or is promoted to a
        full key, new blocks are allocated, and the retired boundary, offered again as vLLM 0.33
        does every step, is refused."""
        req = data.draw(st.sampled_from(self.requests))
        old_tokens, bs = len(req.prefix.tokens), req.block_tokens
        tokens = (req.prefix.tokens + more)[: 8 * H]
        if len(tokens) == old_tokens:
            return
        need = cdiv(len(tokens), bs) - len(req.blocks)
        got = self.pool.allocate(need)
        expected = spec.allocate(self.model, need)
        if expected is None:
            assert got is None
            return
        self.model, taken = expected
        assert tuple(got) == taken
        for b in got:
            self.content[b] = None
        old_prefix = req.prefix
        req.prefix = _prefix(old_prefix.salt, tokens)
        assert req.prefix.hashes[: len(old_prefix.hashes)] == old_prefix.hashes, "hashes must extend"
        req.blocks.extend(got)
        tail = old_tokens // bs
        self._fill(req, tail, old_tokens)
        if old_tokens % bs:  # the old tail boundary, offered again (as vLLM 0.33 does every step)
            again = self._cache_both(req.blocks[tail], key_at(old_prefix.hashes, old_tokens, H, req.group), old_tokens,
                                     full=False, keep=req.keep)
            if req.keep:  # an append-only block still holds it, as a prefix key
                assert again is False, "an append-only block keeps its older boundary as a prefix key"
                event("prefix key kept")
            else:
                assert again is None, "a boundary the block has outgrown must be refused"
                event("stale boundary refused")

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        values = self._values(data, req.blocks)
        self.pool.free(req.blocks[::-1], values)
        self.model = spec.free(self.model, req.blocks[::-1], values)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def pool_is_well_formed(self):
        """INV-POOL-CONSERVE, INV-POOL-NULL, INV-POOL-REF-NONNEG, INV-POOL-FREE-IFF-UNREF,
        INV-POOL-KEY-CONSISTENT, INV-POOL-KEY-LENGTH, INV-POOL-NO-STALE-PARTIAL."""
        assert self.pool._check()
        assert spec.well_formed(self.model)

    @invariant()
    def observables_match_spec(self):
        pool, model = self.pool, self.model
        for b in range(pool.num_blocks):
            assert (pool.ref_count(b), pool.key_of(b), pool.num_tokens_of(b)) == (model.ref[b], model.key[b], model.ntok[b]), b
            assert pool.keys_of(b) == spec.keys_of(model, b), b
        if self.policy == COMPUTE:  # allocation order: uncached, then cached by (priority, release)
            cached = {b for b in model.free if model.key[b] is not None}
            assert pool.free_order() == victims(model.free, cached, {b: model.prio[b] for b in cached}, len(model.free))
            assert pool.released == model.released
            for b in range(1, pool.num_blocks):
                assert pool.priority(b) == (model.prio[b] if b in cached else None), b
        else:
            assert pool.free_order() == model.free
        assert pool.num_free == spec.num_free(model)
        assert pool.num_cached_keys() == len({k for b in range(model.num_blocks) for k, _ in spec.keys_of(model, b)})
        for key in self.keys_seen:
            assert pool.holders(key) == spec.holders(model, key), key
            assert pool.lookup(key) == spec.lookup(model, key), key

    @invariant()
    def references_match_holdings(self):
        """INV-POOL-REF-NONNEG seen from the caller: ref counts are exactly the references held."""
        held = Counter(self.held) + Counter(b for r in self.requests for b in r.blocks)
        for b in range(1, self.pool.num_blocks):
            assert self.pool.ref_count(b) == held[b], b

    @invariant()
    def every_key_names_its_content(self):
        """Content oracle (INV-POOL-HIT-CONTENT): every holder of a key holds the prefix the key
        names, salt and group included -- exactly for its primary key, as a prefix of what it
        holds for a prefix key (append-only contents); hence no stale key and no cross-salt
        sharing."""
        for key, named in self.keys_seen.items():
            for b in self.pool.holders(key):
                held = self.content.get(b)
                ok = held is not None and held[0] == named[0] and held[2] == named[2] and held[1][: len(named[1])] == named[1]
                assert ok, f"block {b} holds {held} but key names {named}"
                if self.pool.key_of(b) == key:
                    assert held == named, f"block {b}'s primary key names {named} but it holds {held}"


class TestBlockPoolMatchesSpec(PoolMachine.TestCase):
    settings = settings(max_examples=250, stateful_step_count=50, deadline=None)

    @classmethod
    def setUpClass(cls):
        REACH.counts.clear()
        REACH.minimums = {"compute: evicted a cached block": 20, "compute: uncached taken before cached": 1,
                          "compute: evicted out of release order": 1, "compute: requeued a cached block": 5,
                          "lru: requeued a cached block": 5}

    @classmethod
    def tearDownClass(cls):
        if PROFILE == "ci":  # a fixed-seed run must reach the hard cases
            assert not REACH.shortfall(), f"the pool machine reached too few: {REACH.shortfall()} of {dict(REACH.counts)}"
