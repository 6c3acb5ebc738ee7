"""Where a hybrid request makes and keeps Mamba states beyond vLLM's rule: the checkpoint policy.

A hit of N tokens needs a Mamba state at exactly N, and a state exists only where a prefill chunk
ended (``spec.chunk_split``) and retention kept it (``spec.retention``). So the positions a
request checkpoints decide which later hits a hybrid model can take at all; the attention layers
alone could take any length their blocks cover.

Policies (``CHECKPOINT_POLICIES``):

- ``vllm`` (default): vLLM 0.33.0's positions, unchanged -- the last checkpoint, the prompt's
  tail, the replay boundaries and the *junctions*, the branch points the key index showed at
  admission (where this prompt's cached prefix ends beyond the joint hit: an earlier request
  diverged there, so the next sibling will too; ``Hit.junctions``).
- ``reuse``: those, plus a *turn-end ladder* of ``budget`` states below the prompt's end.

Why a ladder below the prompt's end. The next turn of a conversation re-sends this prompt and
appends to it, but shares it only up to some ``s = P - d``: a chat template re-renders the
prompt's tail (its generation header becomes the answer), a client trims, and traffic hashed in
coarse blocks shares whole blocks only (the Mooncake trace's 512-token ids). ``d`` is not known
when the state is made; the last checkpoint ``c`` serves only a next turn that shares up to it.
A state a distance ``x`` below ``c`` serves every ``s`` from it up to the next state above, so a
next turn recomputes ``s - (state below s)`` tokens it shares. Asking that this never exceeds how
far ``s`` lies below ``c`` (a tail is recomputed for no longer than it is) forces the states
apart by doubling gaps: one unit ``u`` below ``c``, then two units below that, then four, ... --
each gap as long as the distance of its top from ``c`` plus one unit (INV-CKPT-LADDER). ``k``
rungs reach ``(2**k - 1) * u`` below ``c`` for ``k`` state blocks: the reach grows exponentially
in the budget (INV-CKPT-BUDGET).

``u`` is the *checkpoint unit*: the least length both a hit (a multiple of the cache-hit
alignment, hence of the hash block) and a whole-block Mamba key (a multiple of every Mamba
group's block) land on, so a rung is always a length the lookup tries and retention can key
(INV-CKPT-GRID). Rungs are stops of the chunk split (a state must be made there) and states
retention keeps; a chunk still ends at its first stop, strictly after its start, so a request
still progresses every step it is scheduled (INV-SPLIT-PROGRESS is unchanged).

``impl/chunk_split.py`` and ``spec.retention`` use :func:`turn_end_rungs`; the hot path repeats
the same doubling in plain integers and is tested against it.
"""

from __future__ import annotations

import math

import icontract

from kvproof.spec.chunk_split import checkpoint_position
from kvproof.spec.groups import GroupKind, MambaCacheMode

VLLM = "vllm"
REUSE = "reuse"
CHECKPOINT_POLICIES = (VLLM, REUSE)
#: Rungs of the ``reuse`` policy: states per request beyond vLLM's (its budget). One rung, one unit
#: below the last checkpoint: on the Mooncake trace more rungs cost more attention hits than they
#: bring back (docs/benchmarks.md, "Checkpoint policies").
REUSE_BUDGET = 1


def parse_checkpoints(text: str) -> str:
    """``vllm`` or ``reuse``; ValueError naming the value otherwise."""
    if text not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoint policy {text!r} must be one of {', '.join(CHECKPOINT_POLICIES)}")
    return text


def policy_budget(policy: str) -> int:
    """The rungs a policy keeps per request (0: vLLM's rule)."""
    return REUSE_BUDGET if parse_checkpoints(policy) == REUSE else 0


def checkpoint_unit(alignment: int, mamba_block_sizes: tuple[int, ...]) -> int:
    """The least length a hit and every Mamba group's whole-block key both land on."""
    if alignment < 1 or any(b < 1 for b in mamba_block_sizes):
        raise ValueError(f"alignment {alignment} and Mamba blocks {mamba_block_sizes} must be positive")
    return math.lcm(alignment, *mamba_block_sizes)


def _on_grid(num_prompt_tokens, unit, result) -> bool:
    """INV-CKPT-GRID: every rung is a positive multiple of the unit strictly below the prompt end."""
    return all(0 < r < num_prompt_tokens and r % unit == 0 for r in result)


def _within_budget(budget, result) -> bool:
    """INV-CKPT-BUDGET: at most ``budget`` rungs, all distinct (one state block each)."""
    return len(result) <= budget and len(set(result)) == len(result)


@icontract.require(
    lambda num_prompt_tokens, unit, budget: num_prompt_tokens >= 1 and unit >= 1 and budget >= 0,
    error=lambda num_prompt_tokens, unit, budget: ValueError(
        f"prompt {num_prompt_tokens}, unit {unit}, budget {budget}: expected a prompt and unit >= 1, a budget >= 0"
    ),
    enabled=True,
)
@icontract.ensure(_on_grid, "INV-CKPT-GRID: a rung is a positive multiple of the checkpoint unit below the prompt end")
@icontract.ensure(_within_budget, "INV-CKPT-BUDGET: never more rungs than the policy's budget")
def turn_end_rungs(num_prompt_tokens: int, unit: int, budget: int, eagle: bool = False, lookahead: int = 0) -> tuple[int, ...]:
    """The ladder's states, highest first: below the prompt's last checkpoint at ``unit``, gaps
    of one unit, then two, four, ... (``budget`` of them, those above 0)."""
    top = checkpoint_position(num_prompt_tokens, unit, eagle, lookahead)
    rungs, gap = [], unit
    for _ in range(budget):
        top -= gap
        if top <= 0:
            break
        rungs.append(top)
        gap *= 2
    return tuple(rungs)


def turn_end_ladder(layout) -> tuple[int, int]:
    """A resolved layout's ladder: (rungs per request, checkpoint unit); (0, 0) under ``vllm``
    or without an align-mode Mamba group (no state to place)."""
    budget = policy_budget(layout.config.checkpoints)
    blocks = tuple(g.effective_block_size for g in layout.groups
                   if g.group.kind is GroupKind.MAMBA and g.group.mamba_cache_mode is MambaCacheMode.ALIGN)
    if not budget or not blocks:
        return 0, 0
    return budget, checkpoint_unit(layout.cache_hit_alignment, blocks)
