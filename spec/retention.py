"""Which Mamba states stay in the prefix cache: the retention policy.

A Mamba (linear-attention) state summarises exactly one prefix length and is as large as a whole
block, so keeping every state a request passes through costs memory that attention blocks could use.
vLLM's ``prefix_cache_retention_interval`` chooses (docs/vllm-semantics.md §1, §4.4):

- ``None`` (dense): every state a chunk ends on is kept;
- ``0`` (vLLM's production default): only the states a later request is known to resume at --
  the prompt's *replay boundaries* (a resend of the same prompt, a longer sibling), the prompt's
  tail checkpoint, and the *shared-prefix junctions* the lookup found;
- ``K > 0``: those, plus one state per K-token segment (every multiple of K).

Under kvproof's ``reuse`` checkpoint policy (``spec.checkpoints``) every interval also keeps the
prompt's turn-end ladder (``rungs`` states, at multiples of ``rung_unit``): where the next turn of
a conversation resumes when it shares all but a tail of this prompt.

A state can be kept only where a chunk ended, so every position this policy names is also a
stop of the chunk-split rule (``spec.chunk_split``): the states at the replay boundaries are its
replay stops (with EAGLE they are not the last checkpoint; vLLM has no such stop and keeps them
only when a chunk happens to end there), the tail its tail checkpoint, a junction its junction
stop.

What a position means for each reachable boundary (the junction especially) is defined here
once; ``impl/managers/mamba.py`` asks :func:`keeps_state` for every state it could key.
"""

from __future__ import annotations

import dataclasses
import functools

from kvproof.spec.checkpoints import turn_end_rungs
from kvproof.spec.chunk_split import checkpoint_position, replay_boundaries, state_below


@dataclasses.dataclass(frozen=True)
class RetentionRule:
    """A layout's retention: the interval (None = dense) and the sizes it is measured in.

    ``effective_block_size`` is the Mamba group's block B_g, ``alignment`` the cache-hit
    alignment A (H with partial hits, else the scheduler block size S), ``scheduler_block_size``
    S. ``eagle`` shifts reachable positions down (the draft recomputes the last unit);
    ``hash_block_size`` and ``lookahead`` place the tail. ``rungs`` and ``rung_unit``: the
    checkpoint policy's ladder (``spec.checkpoints``; 0: vLLM's rule).
    """

    interval: int | None
    effective_block_size: int
    hash_block_size: int
    alignment: int
    scheduler_block_size: int
    eagle: bool = False
    lookahead: int = 0
    rungs: int = 0
    rung_unit: int = 0

    def __post_init__(self) -> None:
        if self.interval is not None and (not isinstance(self.interval, int) or self.interval < 0):
            raise ValueError(f"retention interval {self.interval!r} must be None or a non-negative integer")
        for name in ("effective_block_size", "hash_block_size", "alignment", "scheduler_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)!r} must be positive")
        if bool(self.rungs) != bool(self.rung_unit) or self.rung_unit % self.effective_block_size:
            raise ValueError(
                f"rungs {self.rungs} and rung_unit {self.rung_unit}: expected both 0, or a ladder whose unit is a "
                f"multiple of the Mamba block {self.effective_block_size}"
            )


@functools.lru_cache(maxsize=4096)
def _rungs(num_prompt_tokens: int, unit: int, budget: int, eagle: bool, lookahead: int) -> tuple[int, ...]:
    """``turn_end_rungs`` of a prompt, remembered (asked at every kept-candidate chunk end)."""
    return turn_end_rungs(num_prompt_tokens, unit, budget, eagle, lookahead)


@functools.lru_cache(maxsize=4096)
def _tail_checkpoint(num_prompt_tokens: int, hash_block_size: int, eagle: bool, lookahead: int) -> int:
    """``checkpoint_position`` of a prompt, remembered: the manager asks at every kept-candidate
    chunk end, and the contract-checked call costs far more than the arithmetic."""
    return checkpoint_position(num_prompt_tokens, hash_block_size, eagle, lookahead)


def keeps_state(
    n: int,
    rule: RetentionRule,
    *,
    num_prompt_tokens: int,
    junctions: tuple[int, ...] = (),
    exact_junction: bool = False,
) -> bool:
    """Whether the state after ``n`` tokens (a chunk end) stays cached.

    Kept: the prompt's tail checkpoint; block-aligned states (``n % effective_block_size == 0``)
    at segment boundaries and at the block below every reachable boundary (replay boundaries, junctions,
    and with EAGLE one block below a junction); a state inside a block exactly at a junction
    inside the prompt with ``exact_junction``; the checkpoint policy's turn-end rungs. Dense
    retention keeps everything.
    """
    if n <= 0:
        return False
    if rule.interval is None:
        return True
    if n == _tail_checkpoint(num_prompt_tokens, rule.hash_block_size, rule.eagle, rule.lookahead):
        return True  # the prompt's tail: where a sibling replaying the whole prompt resumes
    b = rule.effective_block_size
    if n % b == 0:
        if rule.interval and (rule.interval <= b or n % rule.interval == 0):
            return True
        if rule.rungs and n in _rungs(num_prompt_tokens, rule.rung_unit, rule.rungs, rule.eagle, rule.lookahead):
            return True  # the turn-end ladder (the checkpoint policy)
        reachable = list(replay_boundaries(num_prompt_tokens, rule.scheduler_block_size, rule.eagle))
        for j in junctions:
            reachable.append(j)
            if rule.eagle:
                reachable.append(j - b)
        return any(state_below(p, rule.alignment, b) == n for p in reachable if p > 0)
    return exact_junction and n in junctions and n <= num_prompt_tokens
