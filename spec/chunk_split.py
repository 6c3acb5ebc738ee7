"""Where the scheduler may end a prefill chunk of a request with align-mode Mamba groups.

A Mamba state exists only where a scheduled chunk ends, so chunk ends decide which prefix
lengths can ever be reused. The rule (vLLM 0.33.0's ``_mamba_block_aligned_split``, reference
5.4), stated declaratively:

1. **Target.** A chunk may use ``num_new`` tokens from ``start``. Its *target* is the furthest
   position within them at which a chunk may end on its own: one that finishes the prefill, or
   a multiple of the Mamba block (so the state lands in a whole block). If no such position
   exists, a Mamba block wider than any chunk (``max_prefill_tokens``) forces an unaligned
   step; otherwise the request waits for a step with more budget (the chunk is empty).
2. **Stops.** The chunk then ends at the first *stop* strictly before its target: a position
   whose state a later request will want, so a chunk must end there to materialise it.

The stops, each for a reason of its own:

- the end of the block a mid-block start lies in (chunk ends stay block-aligned after a
  partial hit);
- the last position whose state is worth keeping for this sequence (:func:`checkpoint_position`
  at the Mamba block);
- with partial hash hits, the prompt's own tail checkpoint at hash granularity, where a
  sibling that replays the prompt resumes;
- every *shared-prefix junction* the lookup reported: a length this request shares with
  cached content beyond its hit, where the next sibling will branch (Marconi). The stop is the
  junction itself with ``shared_prefix_checkpoint`` (and inside the prompt), else the furthest
  whole number of Mamba blocks from ``start`` that does not pass it;
- with ``replay_alignment`` set (kvproof, under sparse retention; vLLM has no such stop), the
  states retention keeps for the prompt's *replay boundaries* (:func:`replay_boundaries`, each
  at :func:`state_below` it): with EAGLE they are scheduler-block multiples that the last
  checkpoint is not, and a state exists only where a chunk ends -- vLLM has them only when its
  budget-sized chunks happen to end there (docs/coordinator.md, "Hit parity with vLLM 0.33.0");
- with ``rungs`` set (kvproof's ``reuse`` checkpoint policy, ``spec.checkpoints``; vLLM has no
  such stop), the prompt's *turn-end ladder*: states the next turn of a conversation resumes at
  when it shares all but a tail of this prompt (:func:`kvproof.spec.checkpoints.turn_end_rungs`).

This module is the definition, written for clarity; ``kvproof.impl.chunk_split`` is the
integer fast path the scheduler runs, tested against it.
"""

from __future__ import annotations

import dataclasses

import icontract


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """What the layout and the scheduler configuration fix for every chunk.

    ``max_prefill_tokens`` is the most tokens any one chunk may take: the scheduler's budget,
    lowered to ``long_prefill_token_threshold`` when that is set. ``partial_tail`` is "align
    mode, partial hash hits on and H < S". ``scheduler_block_size`` and ``replay_alignment`` (the
    cache-hit alignment A; both 0: no replay stops, vLLM's rule) place the replay-boundary stops.
    ``rungs`` and ``rung_unit`` (the checkpoint policy's budget and unit, ``spec.checkpoints``;
    both 0: vLLM's rule) place the turn-end ladder's stops.
    """

    mamba_block_size: int
    hash_block_size: int
    max_prefill_tokens: int
    partial_tail: bool = False
    eagle_drop: bool = False
    lookahead: int = 0
    shared_prefix_checkpoint: bool = False
    scheduler_block_size: int = 0
    replay_alignment: int = 0
    rungs: int = 0
    rung_unit: int = 0

    def __post_init__(self) -> None:
        for name in ("mamba_block_size", "hash_block_size", "max_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        for name in ("scheduler_block_size", "replay_alignment", "rungs", "rung_unit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} {value!r} must be a non-negative integer")
        if bool(self.replay_alignment) != bool(self.scheduler_block_size):
            raise ValueError(
                f"replay_alignment {self.replay_alignment} and scheduler_block_size {self.scheduler_block_size}: "
                "expected both set (replay stops) or both 0"
            )
        if bool(self.rungs) != bool(self.rung_unit):
            raise ValueError(f"rungs {self.rungs} and rung_unit {self.rung_unit}: expected both set (a ladder) or both 0")
        if self.rung_unit % self.mamba_block_size or self.rung_unit % self.hash_block_size:
            raise ValueError(
                f"rung_unit {self.rung_unit} must be a multiple of the Mamba block {self.mamba_block_size} "
                f"and of the hash block {self.hash_block_size}"
            )
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead {self.lookahead!r} must be a non-negative integer")


@icontract.require(lambda num_tokens, unit, lookahead: num_tokens >= 1 and unit >= 1 and lookahead >= 0)
@icontract.ensure(
    lambda num_tokens, unit, result: 0 <= result < num_tokens and result % unit == 0,
    "INV-SPLIT-CKPT: a checkpoint is a multiple of its unit strictly below the sequence end",
)
def checkpoint_position(num_tokens: int, unit: int, eagle_drop: bool, lookahead: int = 0) -> int:
    """The last position of a ``num_tokens`` sequence at which a state is worth keeping.

    A hit must leave tokens to compute: at least one (to sample), and the ``lookahead`` tokens
    a hash reads past its block. With EAGLE the draft recomputes the final unit, so the state is
    one unit below the last multiple of ``unit`` the sequence reaches.
    """
    multiples = range(0, num_tokens + 1, unit)
    if eagle_drop:
        return max(multiples[-1] - unit, 0)
    keep = max(1, lookahead)
    return max((p for p in multiples if num_tokens - p >= keep), default=0)


def replay_boundaries(num_prompt_tokens: int, scheduler_block: int, eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying this prompt resumes: a resend of the identical prompt is
    capped at ``num_prompt - 1`` tokens; with EAGLE the draft needs the block above, so both a
    resend and a longer sibling land one scheduler block lower (docs/vllm-semantics.md §5.4)."""
    if not eagle:
        return (num_prompt_tokens - 1,)
    s = scheduler_block
    resend = (num_prompt_tokens - 1) // s * s
    extension = num_prompt_tokens // s * s
    return tuple(sorted({max(resend - s, 0), max(extension - s, 0)}))


def state_below(position: int, alignment: int, block: int) -> int:
    """The Mamba state a hit at ``position`` (at most) resumes from: the last whole block at or
    below the largest hit length (a multiple of ``alignment``) that does not pass ``position``."""
    aligned = position // alignment * alignment
    return aligned // block * block


def prefill_end(num_tokens: int, num_prompt_tokens: int) -> int:
    """Where prefill ends: the prompt, or for a request resumed after preemption with outputs,
    the last known token (its KV is computed by the next decode step)."""
    return max(num_prompt_tokens, num_tokens - 1)


def stops(
    rule: SplitRule, start: int, target: int, num_tokens: int, num_prompt_tokens: int, junctions: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """Positions strictly inside ``(start, target)`` at which the chunk must end (sorted)."""
    b = rule.mamba_block_size
    candidates = set()
    if start % b:
        candidates.add(next(p for p in range(start + 1, start + b + 1) if p % b == 0))
    last = checkpoint_position(num_tokens, b, rule.eagle_drop, rule.lookahead)
    candidates.add(last)
    if rule.partial_tail:
        tail = checkpoint_position(num_prompt_tokens, rule.hash_block_size, rule.eagle_drop, rule.lookahead)
        if last < tail < num_prompt_tokens:
            candidates.add(tail)
    if rule.replay_alignment:
        for p in replay_boundaries(num_prompt_tokens, rule.scheduler_block_size, rule.eagle_drop):
            candidates.add(state_below(p, rule.replay_alignment, b))
    if rule.rungs:
        from kvproof.spec.checkpoints import turn_end_rungs  # it builds on checkpoint_position, above

        candidates.update(turn_end_rungs(num_prompt_tokens, rule.rung_unit, rule.rungs, rule.eagle_drop, rule.lookahead))
    for j in junctions:
        if not start < j < target:
            continue  # a junction behind the start, or not reached by this chunk
        if rule.shared_prefix_checkpoint and j <= num_prompt_tokens:
            candidates.add(j)
        else:
            candidates.add(max(p for p in range(start, j + 1, b)))
    return tuple(sorted(p for p in candidates if start < p < target))


def target_end(rule: SplitRule, start: int, num_new: int, num_tokens: int, num_prompt_tokens: int) -> int:
    """The furthest position a chunk of at most ``num_new`` tokens may end at before stops are
    applied; ``start`` itself means "no progress possible this step"."""
    end = prefill_end(num_tokens, num_prompt_tokens)
    b = rule.mamba_block_size
    allowed = [t for t in range(start + 1, start + num_new + 1) if t >= end or t % b == 0]
    if allowed:
        return allowed[-1]
    return start + num_new if b > rule.max_prefill_tokens else start


def _within_budget(rule, start, num_new, num_tokens, num_prompt_tokens, junctions, result) -> bool:
    """INV-SPLIT-PROGRESS: the chunk stays within its tokens, and is empty only when no
    block-aligned end is within reach and the Mamba block fits in a chunk (the request waits)."""
    if not start <= result <= start + num_new:
        return False
    if result > start:
        return True
    b = rule.mamba_block_size
    return (
        b <= rule.max_prefill_tokens
        and start + num_new < prefill_end(num_tokens, num_prompt_tokens)
        and all(t % b for t in range(start + 1, start + num_new + 1))
    )


def _as_long_as_allowed(rule, start, num_new, num_tokens, num_prompt_tokens, junctions, result) -> bool:
    """INV-SPLIT-ALIGNED: a non-empty chunk ends on a Mamba block boundary, at the prefill end, at
    a stop, or (a block wider than any chunk) wherever its tokens run out; and it is as long as
    the rules allow: it ends at a stop, or no later block-aligned or prefill-ending position was
    within its tokens."""
    if result == start:
        return True
    b, end = rule.mamba_block_size, prefill_end(num_tokens, num_prompt_tokens)
    target = target_end(rule, start, num_new, num_tokens, num_prompt_tokens)
    at_stop = result in stops(rule, start, target, num_tokens, num_prompt_tokens, junctions)
    aligned = result % b == 0 or result >= end or at_stop or (b > rule.max_prefill_tokens and result == start + num_new)
    later = any(t >= end or t % b == 0 for t in range(result + 1, start + num_new + 1))
    return aligned and (at_stop or not later)


def _crosses_no_stop(rule, start, num_new, num_tokens, num_prompt_tokens, junctions, result) -> bool:
    """INV-SPLIT-STOPS: no stop lies strictly inside the chunk."""
    if start >= prefill_end(num_tokens, num_prompt_tokens):
        return True
    target = target_end(rule, start, num_new, num_tokens, num_prompt_tokens)
    return not any(start < s < result for s in stops(rule, start, target, num_tokens, num_prompt_tokens, junctions))


@icontract.require(
    lambda start, num_new, num_tokens: 1 <= num_new <= num_tokens - start,
    error=lambda start, num_new, num_tokens: ValueError(
        f"chunk of {num_new} tokens from {start} must hold 1 .. {num_tokens - start} tokens"
    ),
    enabled=True,
)
@icontract.require(
    lambda start, num_tokens: 0 <= start < num_tokens,
    error=lambda start, num_tokens: ValueError(f"chunk start {start} must lie in [0, {num_tokens})"),
    enabled=True,
)
@icontract.ensure(_within_budget, "INV-SPLIT-PROGRESS: a chunk stays within its tokens and is empty only when it must wait")
@icontract.ensure(_as_long_as_allowed, "INV-SPLIT-ALIGNED: a chunk ends block-aligned, at the prefill end or at a stop, and is as long as allowed")
@icontract.ensure(_crosses_no_stop, "INV-SPLIT-STOPS: a chunk never runs past a Mamba checkpoint or a shared-prefix junction")
def chunk_end(
    rule: SplitRule, start: int, num_new: int, num_tokens: int, num_prompt_tokens: int, junctions: tuple[int, ...] = ()
) -> int:
    """End (exclusive) of the prefill chunk that may take ``num_new`` tokens from ``start``.

    ``num_new`` is already capped by the token budget, the long-prefill threshold and the known
    tokens. Returns ``start`` when the request must wait (no block-aligned end within reach).
    Past the prefill (decode) the chunk is not split.
    """
    if start >= prefill_end(num_tokens, num_prompt_tokens):
        return start + num_new
    target = target_end(rule, start, num_new, num_tokens, num_prompt_tokens)
    if target == start:
        return start
    inside = stops(rule, start, target, num_tokens, num_prompt_tokens, junctions)
    return inside[0] if inside else target
