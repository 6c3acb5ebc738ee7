"""The Mamba chunk-split rule on the scheduler's hot path: ``kvproof.spec.chunk_split.chunk_end``
(the definition, which this is tested against) in plain integer arithmetic -- the spec's
candidate searches and contracts cost more than the rule itself on every scheduled chunk.
:func:`ladder_end` is the checkpoint policy's part, shared with vLLM's Scheduler as kvproof's
manager serves it."""

from __future__ import annotations

from kvproof.spec.chunk_split import SplitRule, replay_boundaries, state_below


def _checkpoint(num_tokens: int, unit: int, eagle_drop: bool, lookahead: int) -> int:
    if eagle_drop:
        return max(num_tokens - num_tokens % unit - unit, 0)
    n = max(num_tokens - max(1, lookahead), 0)
    return n - n % unit


def ladder_end(start: int, end: int, num_prompt: int, rungs: int, unit: int, eagle_drop: bool, lookahead: int) -> int:
    """``end`` clipped to the lowest rung of the prompt's turn-end ladder strictly inside
    ``(start, end)`` (``spec.checkpoints.turn_end_rungs``: ``rungs`` states below the prompt's
    last checkpoint at ``unit``, gaps doubling). Both split rules call this: kvproof's scheduler
    (``ChunkSplitter``) and vLLM's, as kvproof's manager serves it
    (``integrations/vllm/kvproof_scheduler.py``)."""
    gap = unit
    rung = _checkpoint(num_prompt, gap, eagle_drop, lookahead)
    for _ in range(rungs):  # highest rung first
        rung -= gap
        if rung <= start:
            break
        if rung < end:
            end = rung
        gap += gap
    return end


class ChunkSplitter:
    """One layout's split rule; :meth:`end` is called for every prefill chunk."""

    __slots__ = ("mamba_block_size", "hash_block_size", "max_prefill", "partial_tail", "eagle", "lookahead", "exact_junction",
                 "scheduler_block", "replay_alignment", "rungs", "rung_unit", "_replay")

    def __init__(self, rule: SplitRule) -> None:
        self.mamba_block_size = rule.mamba_block_size
        self.hash_block_size = rule.hash_block_size
        self.max_prefill = rule.max_prefill_tokens
        self.partial_tail = rule.partial_tail
        self.eagle = rule.eagle_drop
        self.lookahead = rule.lookahead
        self.exact_junction = rule.shared_prefix_checkpoint
        self.scheduler_block = rule.scheduler_block_size
        self.replay_alignment = rule.replay_alignment
        self.rungs = rule.rungs
        self.rung_unit = rule.rung_unit
        self._replay: dict[int, tuple[int, ...]] = {}  # prompt length -> its replay stops

    def end(self, start: int, num_new: int, num_tokens: int, num_prompt: int, junctions: tuple[int, ...] = ()) -> int:
        """End (exclusive) of the chunk taking at most ``num_new`` tokens from ``start``;
        ``start`` when the request must wait (see the spec)."""
        prefill = num_prompt if num_prompt > num_tokens - 1 else num_tokens - 1
        if start >= prefill:
            return start + num_new
        b = self.mamba_block_size
        end = start + num_new
        if end < prefill:
            aligned = end - end % b
            if aligned > start or b <= self.max_prefill:
                end = aligned
                if end <= start:
                    return start
        target = end
        if start % b:
            boundary = start - start % b + b
            if boundary < end:
                end = boundary
        last = _checkpoint(num_tokens, b, self.eagle, self.lookahead)
        if start < last < end:
            end = last
        if self.partial_tail:
            tail = _checkpoint(num_prompt, self.hash_block_size, self.eagle, self.lookahead)
            if last < tail < num_prompt and start < tail < end:
                end = tail
        if self.replay_alignment:
            for stop in self._replay_stops(num_prompt):
                if start < stop < end:
                    end = stop
        if self.rungs:
            end = ladder_end(start, end, num_prompt, self.rungs, self.rung_unit, self.eagle, self.lookahead)
        for j in junctions:
            if start < j < target:  # a junction the unclipped chunk reaches (vLLM's test)
                stop = j if self.exact_junction and j <= num_prompt else start + (j - start) // b * b
                if start < stop < end:
                    end = stop
        return end

    def _replay_stops(self, num_prompt: int) -> tuple[int, ...]:
        """The states retention keeps at the prompt's replay boundaries (the spec's
        ``state_below`` of each), remembered per prompt length."""
        stops = self._replay.get(num_prompt)
        if stops is None:
            stops = tuple(state_below(p, self.replay_alignment, self.mamba_block_size)
                          for p in replay_boundaries(num_prompt, self.scheduler_block, self.eagle))
            if len(self._replay) > 4096:
                self._replay.clear()
            self._replay[num_prompt] = stops
        return stops
