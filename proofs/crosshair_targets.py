"""Spec functions re-exported for CrossHair with the input domain they are meant for.

CrossHair treats ``@require`` as assumptions and ``@ensure`` as obligations. Each wrapper here
runs the spec's *undecorated* body with the spec's own pre- and postconditions (the same
condition objects, so the text cannot drift) and adds a bound (``MAX_DCP``) that keeps the
search finite, so that CrossHair can confirm every path instead of running out of time.

Not here, because CrossHair cannot confirm them over all paths in minutes (it times out on
their nonlinear integer arithmetic, or fails inside its own symbolic run on ``owning_ranks``):
``effective_block_size``, ``max_num_blocks_per_req``, ``block_table_width``, ``owning_ranks``.
Their invariants are discharged by z3 lemmas and exhaustive checks (docs/proofs.md).

Why not just call the decorated function: CrossHair does not check a callee's contracts
while analysing a caller (it may assume them), so a wrapper around a broken function is
"confirmed" -- the wrapper must carry the postconditions itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import icontract
import icontract._checkers as _checkers  # find_checker: the documented way to read contracts back

from kvproof.spec import geometry, placement
from kvproof.spec.arith import cdiv
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode

#: Bounds that keep CrossHair's search in the range the layout accepts, small enough to finish.
MAX_DCP = 4


def with_domain(fn: Callable, *requires: Callable, body: Callable | None = None) -> Callable:
    """``fn``'s body (or ``body``: a seeded variant) with ``fn``'s own pre- and
    postconditions plus ``requires``."""
    body = body or inspect.unwrap(fn)

    @functools.wraps(body)
    def wrapper(*args, **kwargs):
        return body(*args, **kwargs)

    wrapper.__module__ = __name__  # CrossHair analyses functions defined in the target module
    del wrapper.__wrapped__  # icontract and CrossHair must see this function, not the spec's ...
    wrapper.__signature__ = inspect.signature(body)  # ... with the spec's argument names
    checker = _checkers.find_checker(fn)
    out = wrapper
    for contract in reversed(checker.__postconditions__ if checker else []):
        out = icontract.ensure(contract.condition, contract.description)(out)
    for group in checker.__preconditions__ if checker else []:
        for contract in group:
            out = icontract.require(contract.condition, contract.description)(out)
    for condition in requires:
        out = icontract.require(condition)(out)
    return out


# Domains as named functions, not lambdas: icontract recovers a lambda's text from the
# decorator line it sits on, and these are not decorator lines.
def _lens_domain(num_tokens: int, dcp: int, interleave: int) -> bool:
    return num_tokens >= 0 and 1 <= dcp <= MAX_DCP and interleave >= 1


def _index_domain(position: int, block_size: int, dcp: int) -> bool:
    return position >= 0 and block_size >= 1 and 1 <= dcp <= MAX_DCP


local_seq_lens = with_domain(placement.local_seq_lens, _lens_domain)
table_index = with_domain(placement.table_index, _index_domain)


def _old_max_num_blocks_per_req(group: CacheGroup, dcp: int, max_len: int) -> int:
    """SEEDED BUG for CANARY-CH-MAMBA-WIDTH: the upstream rule divides the Mamba row by DCP."""
    if group.kind is GroupKind.MAMBA and group.mamba_cache_mode is MambaCacheMode.ALIGN:
        return cdiv(max_len, group.block_size * dcp) + group.num_speculative_blocks
    return inspect.unwrap(geometry.max_num_blocks_per_req)(group, dcp, max_len)


def _width_domain(dcp: int, max_len: int) -> bool:
    return 1 <= dcp <= MAX_DCP and 1 <= max_len <= 1 << 20


old_max_num_blocks_per_req = with_domain(geometry.max_num_blocks_per_req, _width_domain, body=_old_max_num_blocks_per_req)
