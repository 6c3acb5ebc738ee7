"""Exhaustive small-scope checks of DCP placement (spec/placement.py) against a reference
built from first principles.

The reference does not reuse the spec's formulas: the owner of a position is vLLM 0.33's
``((p % (bs*D)) // I) % D``, and a rank's local sequence is *the positions it owns, in order*
(its k-th owned position is local position k). A slot is then ``row[local // bs] * bs +
local % bs``. The z3 lemmas prove the spec's formulas for all integers; this runs the spec's
code -- ``slot_mapping``, ``owning_ranks``, ``local_seq_lens`` with their contracts on -- so a
formula the lemmas model but the code gets wrong (or a row that is too short) shows up here.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import icontract

from kvproof.proofs.registry import CHECKED, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec.geometry import max_num_blocks_per_req
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.placement import PAD_SLOT, local_seq_lens, owning_ranks, slot_mapping

SlotMapping = Callable[..., tuple[int, ...]]


def scope() -> Iterator[tuple[int, int, int, bool]]:
    """(dcp, interleave, block_size, sharded) with I | bs: DCP 1-4, block sizes 1-4."""
    for dcp in range(1, 5):
        for block_size in range(1, 5):
            for interleave in range(1, block_size + 1):
                if block_size % interleave == 0:
                    for sharded in (True, False):
                        yield dcp, interleave, block_size, sharded


def reference_slots(max_len: int, row: tuple[int, ...], bs: int, dcp: int, il: int, rank: int, sharded: bool):
    """Slots of positions 0..max_len-1 on ``rank``, from first principles."""
    if not sharded or dcp == 1:
        return tuple(row[p // bs] * bs + p % bs for p in range(max_len))
    out, local = [], 0
    for p in range(max_len):
        if ((p % (bs * dcp)) // il) % dcp == rank:
            out.append(row[local // bs] * bs + local % bs)
            local += 1
        else:
            out.append(PAD_SLOT)
    return tuple(out)


def _row(group: CacheGroup, dcp: int, max_len: int) -> tuple[int, ...]:
    """A row exactly max_num_blocks_per_req wide (padding only hides a short row), with
    distinct block ids, descending and spaced, so that an index mix-up changes the slot."""
    width = max_num_blocks_per_req(group, dcp, max_len)
    return tuple(100 + 2 * (width - 1 - i) for i in range(width))


def check_slot_mapping(mapping: SlotMapping, budget: float) -> Outcome:
    """For every config in scope and every max_len up to two virtual blocks, every rank's
    slot mapping of the positions [0, max_len) equals the reference; each sharded position is
    kept by exactly one rank (``owning_ranks``); no mapping reads past its row."""
    deadline, count = time.monotonic() + budget, 0
    for dcp, il, bs, sharded in scope():
        kind = GroupKind.FULL_ATTENTION if sharded else GroupKind.MAMBA
        group = CacheGroup(kind, bs)
        for max_len in range(1, 2 * bs * dcp + 2):
            if time.monotonic() > deadline:
                return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} mappings")
            row, positions = _row(group, dcp, max_len), tuple(range(max_len))
            where = f"dcp {dcp}, interleave {il}, block_size {bs}, {'sharded' if sharded else 'replicated'}, max_len {max_len}"
            for rank in range(dcp):
                try:
                    got = mapping(positions, row, bs, dcp, il, rank, sharded)
                except (IndexError, icontract.ViolationError) as e:
                    return Outcome(REFUTED, counterexample=f"{where}, rank {rank}: {violation_summary(e)}")
                want = reference_slots(max_len, row, bs, dcp, il, rank, sharded)
                if got != want:
                    p = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
                    return Outcome(
                        REFUTED,
                        counterexample=f"{where}, rank {rank}: position {p} maps to slot {got[p]}, expected {want[p]}",
                    )
                count += 1
            if mapping is slot_mapping:  # owning_ranks answers for the spec's mapping only
                for p in positions:
                    ranks = owning_ranks(p, bs, dcp, il, sharded)  # INV-DCP-OWNER-UNIQUE contract
                    if sharded and dcp > 1 and len(ranks) != 1:
                        return Outcome(REFUTED, counterexample=f"{where}: position {p} kept by ranks {ranks}")
    return Outcome(CHECKED, detail=f"{count:,} (config, max_len, rank) mappings equal the reference")


def check_local_seq_lens(budget: float) -> Outcome:
    """local_seq_lens (contracts on: sum, balance, bound) equals the count of owned positions."""
    deadline, count = time.monotonic() + budget, 0
    for dcp in range(1, 7):
        for il in range(1, 5):
            owned = [0] * dcp
            for n in range(0, 4 * dcp * il + 2):
                if time.monotonic() > deadline:
                    return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} lengths")
                try:
                    lens = local_seq_lens(n, dcp, il)
                except icontract.ViolationError as e:
                    return Outcome(REFUTED, counterexample=f"n {n}, dcp {dcp}, interleave {il}: {violation_summary(e)}")
                if lens != tuple(owned):
                    return Outcome(REFUTED, counterexample=f"n {n}, dcp {dcp}, interleave {il}: {lens} != owned {owned}")
                owned[(n // il) % dcp] += 1  # position n joins its owner's local sequence
                count += 1
    return Outcome(CHECKED, detail=f"{count:,} (n, dcp, interleave) triples")


OBLIGATIONS = (
    Obligation(
        "EXH-SLOT-MAPPING",
        ("INV-SLOT-INDEX-BOUND", "INV-SLOT-TABLE-INDEX", "INV-DCP-SLOT-DISTINCT", "INV-DCP-OWNER-UNIQUE",
         "INV-DCP-LOCAL-IN-BLOCK"),
        "exhaustive",
        "every rank's slot mapping equals the first-principles reference and never reads past its row",
        lambda budget: check_slot_mapping(slot_mapping, budget),
    ),
    Obligation(
        "EXH-LOCAL-SEQ-LENS",
        ("INV-DCP-LOCAL-LEN-SUM", "INV-DCP-LOCAL-LEN-BALANCE", "INV-DCP-LOCAL-LEN-BOUND"),
        "exhaustive",
        "local_seq_lens equals each rank's count of owned positions",
        check_local_seq_lens,
    ),
)
