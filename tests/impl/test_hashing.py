"""Request block hashing: chaining, incremental appends, extra keys, lookahead, keys, bad input."""

from __future__ import annotations

import hashlib
import re
import struct
import warnings

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvproof.impl import hashing
from kvproof.impl.hashing import MultiModalItem, RequestBlockHasher, full_block_key, key_at, request_block_hashes
from kvproof.impl.request import Request

token_lists = st.lists(st.integers(0, 5), max_size=40)


@settings(max_examples=150)
@given(tokens=token_lists, h=st.integers(1, 5), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_incremental_appends_equal_hashing_at_once(tokens, h, cuts):
    """INV-HASH-CHAIN: appending in any pieces gives the same hashes as hashing the whole."""
    hasher = RequestBlockHasher(h)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    added = 0
    for a, b in zip(bounds, bounds[1:]):
        added += hasher.append(tokens[a:b])
    assert hasher.block_hashes == request_block_hashes(tokens, h)
    assert added == len(tokens) // h == len(hasher.block_hashes)
    assert hasher.num_tokens == len(tokens)


@settings(max_examples=150)
@given(tokens=token_lists, h=st.integers(1, 5), lookahead=st.integers(0, 2), split=st.integers(0, 40))
def test_one_token_appends_equal_hashing_at_once(tokens, h, lookahead, split):
    """INV-HASH-CHAIN for the decode step's call: ``append_token`` after a first piece (the
    prompt) gives the same hashes as ``append`` of the whole, block ends and lookahead included."""
    split = min(split, len(tokens))
    one_by_one, at_once = RequestBlockHasher(h, lookahead_tokens=lookahead), RequestBlockHasher(h, lookahead_tokens=lookahead)
    added = one_by_one.append(tokens[:split]) + sum(one_by_one.append_token(t) for t in tokens[split:])
    assert added == at_once.append(tokens)
    assert one_by_one.block_hashes == at_once.block_hashes
    assert one_by_one.num_tokens == len(tokens)


@pytest.mark.parametrize("bad", [-1, 1 << 64, "3", 2.5])
def test_a_bad_sampled_token_changes_neither_the_request_nor_its_hashes(bad):
    """``Request.append_output`` (``append_token``) refuses a bad token, naming it, before
    anything is recorded; the request goes on as if it had never been offered."""
    request = Request("r", [1, 2, 3], 2)
    before = (list(request.token_ids), list(request.block_hashes), request.hasher.num_tokens)
    with pytest.raises(ValueError, match=re.escape(f"token id {bad!r} at position 0 must be an int in [0, 2**64)")):
        request.append_output(bad)
    assert (list(request.token_ids), list(request.block_hashes), request.hasher.num_tokens) == before
    request.append_output(4)
    assert request.block_hashes == request_block_hashes([1, 2, 3, 4], 2)


@settings(max_examples=150)
@given(a=token_lists, b=token_lists, h=st.integers(1, 4))
def test_hash_i_names_exactly_the_prefix(a, b, h):
    """INV-HASH-CHAIN: hash i of two sequences is equal iff their first (i+1)*H tokens are."""
    ha, hb = request_block_hashes(a, h), request_block_hashes(b, h)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[: (i + 1) * h] == b[: (i + 1) * h])


@settings(max_examples=100)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=20), salts=st.lists(st.one_of(st.none(), st.text(max_size=3)), min_size=2, max_size=2, unique=True))
def test_different_cache_salts_never_share_a_hash(tokens, salts):
    """INV-HASH-SALT-ISOLATION: the salt reaches every hash of the chain, not just the first."""
    one, two = (set(request_block_hashes(tokens, 2, cache_salt=s)) for s in salts)
    assert not one & two


def test_lora_and_hash_block_size_separate_namespaces():
    tokens = list(range(8))
    firsts = {
        request_block_hashes(tokens, 2)[0],
        request_block_hashes(tokens, 2, lora_name="adapter")[0],
        request_block_hashes(tokens, 2, lora_name="other")[0],
        request_block_hashes(tokens, 4)[0],  # H is part of the header
    }
    assert len(firsts) == 4


def test_multimodal_items_enter_every_overlapped_block_with_their_relative_offset():
    tokens = [0] * 12
    plain = request_block_hashes(tokens, 4)
    image = request_block_hashes(tokens, 4, mm_items=[MultiModalItem("img", 2, 4)])
    # The item spans [2, 6): blocks 0 and 1 differ, and through the chain so does block 2.
    assert all(p != q for p, q in zip(plain, image))
    shifted = request_block_hashes(tokens, 4, mm_items=[("img", 3, 4)])
    assert shifted[0] != image[0]
    other = request_block_hashes(tokens, 4, mm_items=[("pic", 2, 4)])
    assert other[0] != image[0]


def test_multimodal_record_layout():
    hasher = RequestBlockHasher(4, mm_items=[("a", 0, 2), ("b", 3, 6), ("c", 20, 1)])
    record = hasher._mm_record(4, 8)
    assert record == struct.pack("<I", 1) + b"\1" + struct.pack("<I", 1) + b"b" + struct.pack("<q", -1)
    assert hasher._mm_record(8, 12) == struct.pack("<I", 1) + b"\1\1\0\0\0b" + struct.pack("<q", -5)


def test_canonical_encoding_is_pinned():
    """The stream layout of the module docstring, spelled out: a change is a cache-format change."""
    tokens = [1, 2, 3, 4]
    stream = hashlib.sha256(b"kvproof-prefix-v1\0" + struct.pack("<II", 2, 0) + b"\0" + b"\0" + b"\0")
    expected = []
    for i in range(2):
        stream.update(struct.pack("<2Q", *tokens[2 * i : 2 * i + 2]))
        expected.append(stream.digest())
    assert request_block_hashes(tokens, 2) == expected


def test_lookahead_delays_hashing_and_covers_the_next_tokens():
    hasher = RequestBlockHasher(2, lookahead_tokens=3)
    assert hasher.append([1, 2, 3, 4]) == 0  # 0 + 2 <= 4 - 3 fails
    assert hasher.append([5]) == 1
    with_next = hasher.block_hashes[0]
    other = RequestBlockHasher(2, lookahead_tokens=3, token_ids=[1, 2, 3, 4, 9])
    assert other.block_hashes[0] != with_next  # lookahead token 5 vs 9 changes hash 0
    assert RequestBlockHasher(2, token_ids=[1, 2]).block_hashes[0] != with_next


def test_xxh3_warns_once_and_differs_from_sha256(monkeypatch):
    monkeypatch.setattr(hashing, "_xxh3_warned", False)
    with pytest.warns(RuntimeWarning, match="not collision resistant"):
        fast = request_block_hashes([1, 2, 3, 4], 2, algo="xxh3_128")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        request_block_hashes([1, 2], 2, algo="xxh3_128")  # no second warning
    assert len(fast[0]) == 16 and fast != request_block_hashes([1, 2, 3, 4], 2)


def test_key_at_and_full_block_key():
    hashes = request_block_hashes(range(12), 2)
    assert key_at(hashes, 2, 2, 0) == (hashes[0], 0)
    assert key_at(hashes, 12, 2, 3) == (hashes[5], 3)
    assert full_block_key(hashes, 1, 6, 2, 1) == key_at(hashes, 12, 2, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, 2, 0), r"INV-HASH-BOUNDARY: num_tokens 3 is not a multiple of hash_block_size 2"),
        ((0, 2, 0), r"INV-HASH-BOUNDARY: num_tokens 0 must lie in \[2, 12\] \(6 hashes of 2 tokens\)"),
        ((14, 2, 0), r"INV-HASH-BOUNDARY: num_tokens 14 must lie in \[2, 12\]"),
        ((-2, 2, 0), r"INV-HASH-BOUNDARY: num_tokens -2 must lie in"),
        ((4, 0, 0), r"hash_block_size 0 must be an int > 0"),
        ((4, 2, -1), r"group_id -1 must be an int >= 0"),
    ],
)
def test_key_at_rejects_bad_boundaries(args, message):
    hashes = request_block_hashes(range(12), 2)
    with pytest.raises(ValueError, match=message):
        key_at(hashes, *args)


def test_full_block_key_rejects_a_block_size_h_does_not_divide():
    with pytest.raises(ValueError, match=r"block size 5 must be a positive multiple of hash_block_size 2"):
        full_block_key(request_block_hashes(range(12), 2), 0, 5, 2, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hash_block_size": 0}, r"hash_block_size 0 must be an int > 0"),
        ({"hash_block_size": 2, "lookahead_tokens": -1}, r"lookahead_tokens -1 must be an int >= 0"),
        ({"hash_block_size": 2, "algo": "md5"}, r"hash algorithm 'md5' is not one of \('sha256', 'xxh3_128'\)"),
        ({"hash_block_size": 2, "mm_items": [("a", 5, 1), ("b", 2, 1)]}, r"sorted by offset: 2 follows 5"),
        ({"hash_block_size": 2, "mm_items": [("a", -1, 1)]}, r"offset -1 must be an int >= 0"),
        ({"hash_block_size": 2, "mm_items": [("a", 0, 0)]}, r"length 0 must be an int > 0"),
        ({"hash_block_size": 2, "cache_salt": 7}, r"cache_salt 7 must be a str or None"),
    ],
)
def test_hasher_rejects_bad_configuration(kwargs, message):
    h = kwargs.pop("hash_block_size")
    with pytest.raises(ValueError, match=message):
        RequestBlockHasher(h, **kwargs)


@pytest.mark.parametrize("bad", [-1, 1 << 64, "3", 2.5])
def test_bad_tokens_are_rejected_without_changing_the_hasher(bad):
    hasher = RequestBlockHasher(2, token_ids=[1, 2, 3])
    before = (list(hasher.block_hashes), hasher.num_tokens)
    with pytest.raises(ValueError, match=re.escape(f"token id {bad!r} at position 1 must be an int in [0, 2**64)")):
        hasher.append([4, bad])
    assert (list(hasher.block_hashes), hasher.num_tokens) == before
    hasher.append([4])
    assert hasher.block_hashes == request_block_hashes([1, 2, 3, 4], 2)


# --- the native SHA-256 stream ----------------------------------------------------------------

native = pytest.mark.skipif(not hashing.NATIVE_SHA256, reason="native SHA-256 stream not built")


@native
@settings(max_examples=60)
@given(
    st.lists(st.integers(0, 2**40), max_size=300),
    st.sampled_from([1, 2, 16, 64]),
    st.integers(0, 5),
    st.lists(st.integers(1, 40), max_size=8),
)
def test_native_stream_gives_hashlibs_digests(tokens, h, lookahead, cuts):
    """Hashes from the native stream equal those of the hashlib path, however tokens arrive."""
    pieces, start = [], 0
    for c in cuts:
        pieces.append(tokens[start:start + c])
        start += c
    pieces.append(tokens[start:])

    def run():
        hasher = hashing.RequestBlockHasher(h, lookahead_tokens=lookahead, cache_salt="s")
        for piece in pieces:
            hasher.append(piece)
        return list(hasher.block_hashes)

    fast = run()
    saved = hashing.Sha256Stream
    hashing.Sha256Stream = None  # the pure-Python path: hashlib, one update + digest per block
    try:
        slow = run()
    finally:
        hashing.Sha256Stream = saved
    assert fast == slow


@native
def test_native_absorb_refuses_to_read_past_its_buffer():
    stream = hashing.Sha256Stream(b"x")
    with pytest.raises(ValueError, match="overrun a 16-byte buffer"):
        stream.absorb_blocks(b"\0" * 16, 2, 8, 16, [])
