"""vLLM 0.33.0's chunk split with kvproof's checkpoint policy: where vLLM's Scheduler owns the
split, the Scheduler carries kvproof's rule.

A hybrid hit needs a Mamba state at exactly its length, and a state exists only where a prefill
chunk ended. vLLM's Scheduler clips every prefill chunk in ``_mamba_block_aligned_split`` (its
block boundaries, the last checkpoint, the prompt's tail, the shared-prefix junction); the
manager cannot move those ends. Under ``KVPROOF_OPTIONS="checkpoints=reuse"`` kvproof's manager
keeps the states of each prompt's turn-end ladder (``spec.checkpoints``), so the split must end
chunks there too: :func:`with_ladder` wraps vLLM's split and clips its chunk once more, at the
lowest rung strictly inside it (``impl.chunk_split.ladder_end``, the rule kvproof's own scheduler
uses). A rung is a positive multiple of the checkpoint unit, hence of the Mamba block, so the
chunk stays block aligned; it lies strictly after the chunk's start, so a request still
progresses every step it is scheduled.

The ladder comes from the manager (``KvproofKVCacheManager.ladder``, from the layout it resolved
under the serving options); vLLM's own manager has none, and then the split is vLLM's, unchanged.

Installed two ways: ``KVPROOF_MANAGER=kvproof`` wraps ``Scheduler._mamba_block_aligned_split``
in every process (plugin.py); :class:`KvproofScheduler` is the same as a subclass, for drivers
that build the Scheduler themselves (the engine harness, ``kvproof plan --engine vllm``).
"""

from __future__ import annotations

import functools

from vllm.v1.core.sched.scheduler import Scheduler

from kvproof.impl.chunk_split import ladder_end


def with_ladder(split):
    """vLLM's split method ``split`` followed by the manager's turn-end ladder stops. Pure
    (reads the request and the scheduler)."""

    @functools.wraps(split)
    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        n = split(self, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        rungs, unit = getattr(self.kv_cache_manager, "ladder", (0, 0))
        if not rungs or n <= 0:
            return n
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        end = ladder_end(start, start + n, request.num_prompt_tokens, rungs, unit, self.use_eagle_block_drop,
                         self.num_hash_lookahead_tokens)
        return end - start

    _mamba_block_aligned_split.__wrapped__ = split
    return _mamba_block_aligned_split


class KvproofScheduler(Scheduler):
    """vLLM's ``Scheduler`` whose chunk split also ends at kvproof's checkpoint ladder (above)."""

    _mamba_block_aligned_split = with_ladder(Scheduler._mamba_block_aligned_split)
