"""Request block hashes at hash-block granularity H, and the one cache key built from them.

``block_hashes[i]`` names the whole prefix ``[0, (i+1)*H)`` of a request together with its extra
keys, so a cache key is simply ``(block_hashes[N/H - 1], group_id)`` for any N that is a multiple
of H (:func:`key_at`), for full and partial entries of every group alike.

Construction (docs/benchmarks.md has the measurements behind it)
----------------------------------------------------------------
vLLM 0.33 computes ``h_i = f(pickle((h_{i-1}, tuple(tokens_i), extra_i)))``: one pickle and one
fresh hash object per block. Here one hash object per request absorbs a canonical byte stream and
``h_i`` is its digest right after block i's record::

    stream  = header || record_0 || record_1 || ...
    header  = b"kvproof-prefix-v1\\0" || u32 H || u32 L || field(cache_salt) || field(lora_name)
              || u8 has_multimodal
    record_i = tokens[iH : iH+H+L] as u64 little-endian   (block i, then its L lookahead tokens)
              || (if has_multimodal) u32 count || per overlapping item:
                 field(identifier) || i64 (offset - iH)
    field(x) = b"\\0" if x is None else b"\\1" || u32 len(utf8(x)) || utf8(x)

The header fixes the record layout, so the stream parses back uniquely: two different prefixes
(tokens, salt, LoRA, multimodal items, lookahead) give different byte strings, and equal digests
mean a SHA-256 collision. The cache salt sits in the header, so, as with vLLM's salt-on-block-0
plus chaining, two salts never share any hash (INV-HASH-SALT-ISOLATION). Tokens are packed with
``array('Q')`` (no per-token Python objects). For SHA-256 without multimodal items, the native
stream (``impl/_sha256_stream.c``, OpenSSL) absorbs a run of records and returns their digests in
one call; without it (not built), each block costs one ``update`` and one ``digest`` call on
hashlib. Both give the same digests (tests/impl/test_hashing.py).

``xxh3_128`` is not collision resistant: a crafted prompt can collide with another tenant's
prefix and read its KV. It warns once per process.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import warnings
from array import array
from typing import Iterable, NamedTuple, NoReturn, Optional, Sequence

import xxhash

try:  # the native stream (impl/_sha256_stream.c): same digests, one call per run of blocks
    from kvproof.impl._sha256_stream import Sha256Stream
except ImportError:  # not built (no compiler or OpenSSL headers): hashlib, per block
    Sha256Stream = None

#: Whether SHA-256 request hashing runs in native code.
NATIVE_SHA256 = Sha256Stream is not None

HASH_ALGOS = ("sha256", "xxh3_128")
DEFAULT_HASH_ALGO = "sha256"

_MAGIC = b"kvproof-prefix-v1\0"
_TOKEN_BYTES = 8
_TOKEN_LIMIT = 1 << 64
# Appends of up to this many tokens that complete no hash block are only validated and kept
# as ints; packing waits for the block to complete (decode appends one token per step).
_STASH_MAX = 8
_NEEDS_BYTESWAP = sys.byteorder != "little"
_xxh3_warned = False


class MultiModalItem(NamedTuple):
    """A multimodal input occupying token positions ``[offset, offset + length)``.

    ``identifier`` names its content (e.g. a content hash). Every block the item overlaps
    carries ``(identifier, offset - block_start)`` in its hash.
    """

    identifier: str
    offset: int
    length: int


def _field(value: Optional[str]) -> bytes:
    if value is None:
        return b"\0"
    raw = value.encode("utf-8")
    return b"\1" + struct.pack("<I", len(raw)) + raw


def _new_stream(algo: str):
    global _xxh3_warned
    if algo == "sha256":
        return Sha256Stream() if Sha256Stream is not None else hashlib.sha256()
    if algo == "xxh3_128":
        if not _xxh3_warned:
            _xxh3_warned = True
            warnings.warn(
                "prefix hashing with xxh3_128 is not collision resistant: a crafted prompt can "
                "collide with another request's prefix and read its KV cache; use sha256 when "
                "untrusted requests share the cache",
                RuntimeWarning,
                stacklevel=3,
            )
        return xxhash.xxh3_128()
    raise ValueError(f"hash algorithm {algo!r} is not one of {HASH_ALGOS}")


def _pack_tokens(token_ids: Iterable[int]) -> array:
    """Token ids as unsigned 64-bit little-endian words (``array('Q')`` converts ~3x faster than 'q')."""
    try:
        packed = array("Q", token_ids)
    except (OverflowError, TypeError) as exc:
        tokens = list(token_ids)
        for i, t in enumerate(tokens):
            if not (isinstance(t, int) and 0 <= t < 1 << 64):
                raise ValueError(f"token id {t!r} at position {i} must be an int in [0, 2**64)") from exc
        raise ValueError(f"token ids could not be packed: {exc}") from exc
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed


def _validated_mm_items(items: Iterable[MultiModalItem | tuple]) -> tuple[MultiModalItem, ...]:
    out = tuple(MultiModalItem(*item) for item in items)
    previous = -1
    for item in out:
        if not isinstance(item.identifier, str):
            raise ValueError(f"multimodal identifier {item.identifier!r} must be a str")
        if not (isinstance(item.offset, int) and item.offset >= 0):
            raise ValueError(f"multimodal item {item.identifier!r}: offset {item.offset!r} must be an int >= 0")
        if not (isinstance(item.length, int) and item.length > 0):
            raise ValueError(f"multimodal item {item.identifier!r}: length {item.length!r} must be an int > 0")
        if item.offset < previous:
            raise ValueError(f"multimodal items must be sorted by offset: {item.offset} follows {previous}")
        previous = item.offset
    return out


class RequestBlockHasher:
    """Incremental block hashes of one request's tokens (see the module docstring for the encoding).

    ``block_hashes[i]`` names the prefix ``[0, (i+1)*H)``; a hash block is hashed once
    ``(i+1)*H <= num_tokens - lookahead_tokens``, and partial trailing blocks never are.
    ``block_hashes`` is the hasher's own list, exposed without a copy for speed: read it, never
    modify it.
    """

    __slots__ = (
        "hash_block_size", "lookahead_tokens", "algo", "block_hashes", "_num_tokens",
        "_pending", "_unpacked", "_next_ready", "_stream", "_mm_items", "_mm_first",
    )

    def __init__(
        self,
        hash_block_size: int,
        *,
        algo: str = DEFAULT_HASH_ALGO,
        cache_salt: Optional[str] = None,
        lora_name: Optional[str] = None,
        mm_items: Iterable[MultiModalItem | tuple] = (),
        lookahead_tokens: int = 0,
        token_ids: Iterable[int] = (),
    ) -> None:
        """Start hashing a request; ``token_ids`` (optional) are appended at once."""
        if not (isinstance(hash_block_size, int) and hash_block_size > 0):
            raise ValueError(f"hash_block_size {hash_block_size!r} must be an int > 0")
        if not (isinstance(lookahead_tokens, int) and lookahead_tokens >= 0):
            raise ValueError(f"lookahead_tokens {lookahead_tokens!r} must be an int >= 0")
        for name, value in (("cache_salt", cache_salt), ("lora_name", lora_name)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} {value!r} must be a str or None")
        self.hash_block_size = hash_block_size
        self.lookahead_tokens = lookahead_tokens
        self.algo = algo
        self._mm_items = _validated_mm_items(mm_items)
        self._mm_first = 0  # items before this index end before the next block starts
        self._stream = _new_stream(algo)
        self._stream.update(
            _MAGIC
            + struct.pack("<II", hash_block_size, lookahead_tokens)
            + _field(cache_salt)
            + _field(lora_name)
            + (b"\1" if self._mm_items else b"\0")
        )
        self.block_hashes: list[bytes] = []
        self._num_tokens = 0
        self._pending = bytearray()  # packed tokens from the first unhashed block onward...
        self._unpacked: list[int] = []  # ...followed by these validated, not yet packed ones
        self._next_ready = hash_block_size + lookahead_tokens  # token count that completes the next block
        if token_ids:
            self.append(token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far."""
        return self._num_tokens

    def append_token(self, token: int) -> int:
        """Mutates. ``append((token,))`` for one sampled token: a decode step's call, without
        the tuple and the loop while the token completes no hash block."""
        if self._num_tokens + 1 < self._next_ready and type(token) is int and 0 <= token < _TOKEN_LIMIT:
            self._unpacked.append(token)
            self._num_tokens += 1
            return 0
        return self.append((token,))

    def append(self, token_ids: Iterable[int]) -> int:
        """Mutates. Append tokens and hash every hash block that became complete (lookahead
        included). Returns how many hashes were added. Invalid tokens raise ValueError and
        change nothing."""
        if type(token_ids) is not list and type(token_ids) is not tuple:
            token_ids = list(token_ids)
        total = self._num_tokens + len(token_ids)
        if total < self._next_ready and len(token_ids) <= _STASH_MAX:  # the decode fast path
            for t in token_ids:
                if type(t) is not int or not 0 <= t < _TOKEN_LIMIT:
                    _pack_tokens(token_ids)  # raises the ValueError naming the token (or accepts a bool)
            self._unpacked += token_ids
            self._num_tokens = total
            return 0
        h = self.hash_block_size
        first = len(self.block_hashes)
        ready = (total - self.lookahead_tokens) // h - first
        packed = _pack_tokens(token_ids)
        if self._unpacked:
            self._pending += _pack_tokens(self._unpacked)
            self._unpacked.clear()
        self._pending += packed  # bytearray += array copies the raw bytes
        self._num_tokens = total
        if ready <= 0:
            return 0
        step = h * _TOKEN_BYTES
        record = step + self.lookahead_tokens * _TOKEN_BYTES
        view = memoryview(self._pending)
        try:
            update, digest, out = self._stream.update, self._stream.digest, self.block_hashes
            if not self._mm_items and type(self._stream) is Sha256Stream:
                self._stream.absorb_blocks(view, ready, step, record, out)
            elif not self._mm_items:
                for start in range(0, ready * step, step):
                    update(view[start : start + record])
                    out.append(digest())
            else:
                for i, start in enumerate(range(0, ready * step, step), start=first):
                    update(view[start : start + record])
                    update(self._mm_record(i * h, i * h + h + self.lookahead_tokens))
                    out.append(digest())
        finally:
            view.release()
        del self._pending[: ready * step]
        self._next_ready = (first + ready + 1) * h + self.lookahead_tokens
        return ready

    def _mm_record(self, start: int, end: int) -> bytes:
        """The multimodal part of the record of the block covering positions ``[start, end)``."""
        items = self._mm_items
        while self._mm_first < len(items) and items[self._mm_first].offset + items[self._mm_first].length <= start:
            self._mm_first += 1
        parts = []
        for item in items[self._mm_first :]:
            if item.offset >= end:
                break
            if item.offset + item.length > start:
                parts.append(_field(item.identifier) + struct.pack("<q", item.offset - start))
        return struct.pack("<I", len(parts)) + b"".join(parts)


def request_block_hashes(token_ids: Sequence[int], hash_block_size: int, **options) -> list[bytes]:
    """The block hashes of a whole token sequence (options as for :class:`RequestBlockHasher`)."""
    return RequestBlockHasher(hash_block_size, token_ids=token_ids, **options).block_hashes


def key_at(block_hashes: Sequence[bytes], num_tokens: int, hash_block_size: int, group_id: int) -> tuple[bytes, int]:
    """The cache key of prefix ``[0, num_tokens)`` in a group: ``(block_hashes[N/H - 1], group_id)``.

    N must be a multiple of H with ``0 < N/H <= len(block_hashes)``; full-block and partial
    entries of every group use this one function (INV-HASH-BOUNDARY). Cheap enough for every
    key the managers take: one combined test on the common path, the messages only on failure.
    """
    if (
        type(num_tokens) is int and type(hash_block_size) is int and type(group_id) is int
        and hash_block_size > 0 and group_id >= 0 and 0 < num_tokens <= len(block_hashes) * hash_block_size
        and not num_tokens % hash_block_size
    ):
        return block_hashes[num_tokens // hash_block_size - 1], group_id
    _reject_boundary(block_hashes, num_tokens, hash_block_size, group_id)


def _reject_boundary(block_hashes: Sequence[bytes], num_tokens, hash_block_size, group_id) -> NoReturn:
    """Raise the ValueError naming what :func:`key_at` was given and what it expected."""
    if isinstance(hash_block_size, bool) or not (isinstance(hash_block_size, int) and hash_block_size > 0):
        raise ValueError(f"hash_block_size {hash_block_size!r} must be an int > 0")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens % hash_block_size:
        raise ValueError(f"INV-HASH-BOUNDARY: num_tokens {num_tokens!r} is not a multiple of hash_block_size {hash_block_size}")
    if not 0 < num_tokens // hash_block_size <= len(block_hashes):
        raise ValueError(
            f"INV-HASH-BOUNDARY: num_tokens {num_tokens} must lie in [{hash_block_size}, {len(block_hashes) * hash_block_size}] "
            f"({len(block_hashes)} hashes of {hash_block_size} tokens)"
        )
    raise ValueError(f"group_id {group_id!r} must be an int >= 0")


def full_block_key(
    block_hashes: Sequence[bytes], block_index: int, block_size: int, hash_block_size: int, group_id: int
) -> tuple[bytes, int]:
    """Key of full block ``block_index`` of a group whose effective block size is ``block_size``:
    the fine hash at ``(block_index + 1) * block_size`` tokens."""
    if not (isinstance(block_size, int) and block_size > 0 and block_size % hash_block_size == 0):
        raise ValueError(f"block size {block_size!r} must be a positive multiple of hash_block_size {hash_block_size}")
    if not (isinstance(block_index, int) and block_index >= 0):
        raise ValueError(f"block_index {block_index!r} must be an int >= 0")
    return key_at(block_hashes, (block_index + 1) * block_size, hash_block_size, group_id)
