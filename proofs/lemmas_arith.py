"""z3 lemmas on the arithmetic helpers and block-table widths (spec/arith.py, spec/geometry.py).

Each lemma's ``spec_values`` runs the spec function it is about, so the fidelity check of
:mod:`kvproof.proofs.z3kit` ties the z3 formula to the code.
"""

from __future__ import annotations

from typing import Callable

import z3

from kvproof.proofs.z3kit import Lemma, divmod_def, grid, lemma_obligation
from kvproof.spec.arith import cdiv, floor_to
from kvproof.spec.geometry import block_table_width, max_num_blocks_per_req
from kvproof.spec.groups import CacheGroup, GroupKind

# ---------------------------------------------------------------------------------------------
# cdiv / floor_to
# ---------------------------------------------------------------------------------------------

# cdiv(a, b) == -((-a) // b): the quotient of -a is the one division in it.
CDIV_LEAST = Lemma(
    inputs=("a", "b"),
    domain=lambda v: z3.And(v.a >= 0, v.b >= 1),
    definitions=lambda v: z3.And(divmod_def(-v.a, v.b, v.nq, v.nr), v.c == -v.nq),
    steps=(
        lambda v: v.c * v.b >= v.a,
        lambda v: z3.Or(z3.And(v.c * v.b >= v.a, v.a > (v.c - 1) * v.b), z3.And(v.a == 0, v.c == 0)),
    ),
    spec_values=lambda x: dict(zip(("nq", "nr"), divmod(-x["a"], x["b"]))) | {"c": cdiv(x["a"], x["b"])},
    samples=grid(a=range(0, 40), b=range(1, 12)),
)

FLOOR_LARGEST = Lemma(
    inputs=("x", "a"),
    domain=lambda v: z3.And(v.x >= 0, v.a >= 1),
    definitions=lambda v: z3.And(divmod_def(v.x, v.a, v.q, v.r), v.f == v.x - v.r),
    steps=(lambda v: z3.And(v.f == v.q * v.a, v.f <= v.x, v.x < v.f + v.a),),
    spec_values=lambda x: dict(zip(("q", "r"), divmod(x["x"], x["a"]))) | {"f": floor_to(x["x"], x["a"])},
    samples=grid(x=range(0, 40), a=range(1, 12)),
)

# ---------------------------------------------------------------------------------------------
# Block-table widths
# ---------------------------------------------------------------------------------------------

# INV-TABLE-PAD for every entry alignment `step` (the spec's step is align // gcd(align, bs);
# quantifying over every step >= 1 covers whichever it is). The spec is sampled with bs = 1,
# where its step equals the alignment.
TABLE_PAD = Lemma(
    inputs=("n", "step"),
    domain=lambda v: z3.And(v.n >= 0, v.step >= 1),
    definitions=lambda v: z3.And(divmod_def(-v.n, v.step, v.nq, v.nr), v.w == -v.nq * v.step),
    steps=(lambda v: z3.And(v.n <= v.w, v.w < v.n + v.step),),
    spec_values=lambda x: dict(zip(("nq", "nr"), divmod(-x["n"], x["step"])))
    | {"w": block_table_width(x["n"], 1, x["step"])},
    samples=grid(n=range(0, 30), step=range(1, 10)),
)


def mamba_width(dcp: int, block_size: int, max_len: int, spec_blocks: int) -> int:
    group = CacheGroup(GroupKind.MAMBA, block_size, num_speculative_blocks=spec_blocks)
    return max_num_blocks_per_req(group, dcp, max_len)


def mamba_width_covers(width_of: Callable[[int, int, int, int], int], divided_by_dcp: bool) -> Lemma:
    """The replicated Mamba row covers ceil(max_len / bs) blocks, whatever the DCP size.

    ``width * bs >= max_len`` is ``width >= ceil(max_len / bs)`` without a ceiling. The
    canary passes the old rule (``divided_by_dcp``) and its seeded width function.
    """

    def divisor(v):
        return v.bs * v.dcp if divided_by_dcp else v.bs

    return Lemma(
        inputs=("dcp", "bs", "max_len", "sp"),
        domain=lambda v: z3.And(v.dcp >= 1, v.bs >= 1, v.max_len >= 1, v.sp >= 0),
        definitions=lambda v: z3.And(
            v.d == divisor(v), divmod_def(-v.max_len, v.d, v.nq, v.nr), v.width == -v.nq + v.sp
        ),
        steps=(lambda v: v.width * v.bs >= v.max_len,),
        spec_values=lambda x: _mamba_values(x, width_of, divided_by_dcp),
        samples=grid(dcp=range(1, 5), bs=range(1, 6), max_len=range(1, 13), sp=range(0, 3)),
        describe=lambda x: (
            f"the row has {x['width']} entries of {x['bs']} tokens = {x['width'] * x['bs']} positions, "
            f"fewer than max_len {x['max_len']} (needs ceil({x['max_len']}/{x['bs']}) + {x['sp']} = "
            f"{cdiv(x['max_len'], x['bs']) + x['sp']})"
        ),
    )


def _mamba_values(x: dict[str, int], width_of, divided_by_dcp: bool) -> dict[str, int]:
    d = x["bs"] * x["dcp"] if divided_by_dcp else x["bs"]
    nq, nr = divmod(-x["max_len"], d)
    return {"d": d, "nq": nq, "nr": nr, "width": width_of(x["dcp"], x["bs"], x["max_len"], x["sp"])}


SHARDED_WIDTH_COVERS = Lemma(
    inputs=("dcp", "bs", "max_len"),
    domain=lambda v: z3.And(v.dcp >= 1, v.bs >= 1, v.max_len >= 1),
    definitions=lambda v: z3.And(
        v.vb == v.bs * v.dcp, divmod_def(-v.max_len, v.vb, v.nq, v.nr), v.width == -v.nq
    ),
    steps=(lambda v: v.width * v.vb >= v.max_len,),
    spec_values=lambda x: {
        "vb": x["bs"] * x["dcp"],
        **dict(zip(("nq", "nr"), divmod(-x["max_len"], x["bs"] * x["dcp"]))),
        "width": max_num_blocks_per_req(CacheGroup(GroupKind.FULL_ATTENTION, x["bs"]), x["dcp"], x["max_len"]),
    },
    samples=grid(dcp=range(1, 5), bs=range(1, 6), max_len=range(1, 25)),
)

OBLIGATIONS = (
    lemma_obligation(
        "LEM-CDIV-LEAST", ("INV-ARITH-CDIV",),
        "cdiv(a, b) * b >= a, and cdiv(a, b) is the least such k", CDIV_LEAST,
    ),
    lemma_obligation(
        "LEM-FLOOR-LARGEST", ("INV-ARITH-FLOOR",),
        "floor_to(x, a) is a multiple of a with floor_to(x, a) <= x < floor_to(x, a) + a", FLOOR_LARGEST,
    ),
    lemma_obligation(
        "LEM-TABLE-PAD", ("INV-TABLE-PAD",),
        "the padded width is the least multiple of the entry step that is >= n", TABLE_PAD,
    ),
    lemma_obligation(
        "LEM-MAMBA-WIDTH", ("INV-TABLE-WIDTH", "INV-GEOM-MAMBA-REPLICATED"),
        "the Mamba row cdiv(L, bs) + Sp is never below ceil(L / bs), for any DCP size",
        mamba_width_covers(mamba_width, divided_by_dcp=False),
    ),
    lemma_obligation(
        "LEM-SHARDED-WIDTH", ("INV-TABLE-WIDTH",),
        "the sharded row cdiv(L, bs*D) covers L positions", SHARDED_WIDTH_COVERS,
    ),
)
