"""z3 lemmas on DCP placement (spec/placement.py): owners, local positions, slot-mapping
indices and local sequence lengths, for all integers.

Variables: ``p`` a global position, ``dcp`` the DCP size, ``il`` the interleave I, ``k`` the
block size in interleave runs (``bs = k * il``: the layout requires I | bs).
"""

from __future__ import annotations

import z3

from kvproof.proofs.z3kit import Lemma, clamp, divmod_def, grid, lemma_obligation
from kvproof.spec.arith import cdiv
from kvproof.spec.geometry import max_num_blocks_per_req
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.placement import local_position, local_seq_len, owner_rank, table_index

SMALL = dict(dcp=range(1, 5), il=range(1, 4))


def _owner_defs(v, p, x, e, a, owner):
    """owner_rank(p, dcp, il) == (p // il) % dcp."""
    return z3.And(divmod_def(p, v.il, x, e), divmod_def(x, v.dcp, a, owner))


def _owner_values(p: int, dcp: int, il: int, suffix: str = "") -> dict[str, int]:
    x, e = divmod(p, il)
    return {f"x{suffix}": x, f"e{suffix}": e, f"a{suffix}": x // dcp, f"owner{suffix}": owner_rank(p, dcp, il)}


OWNER_UNIQUE = Lemma(
    inputs=("dcp", "il", "p"),
    domain=lambda v: z3.And(v.dcp >= 1, v.il >= 1, v.p >= 0),
    definitions=lambda v: _owner_defs(v, v.p, v.x, v.e, v.a, v.owner),
    # A rank keeps a sharded position iff it is the owner (slot_for_position), so an owner
    # in [0, dcp) means exactly one rank keeps it.
    steps=(lambda v: z3.And(0 <= v.owner, v.owner < v.dcp),),
    spec_values=lambda x: _owner_values(x["p"], x["dcp"], x["il"]),
    samples=grid(**SMALL, p=range(0, 30)),
)

# vLLM 0.33 computes the owner from the offset inside the virtual block of bs*dcp positions.
OWNER_MATCHES_VLLM = Lemma(
    inputs=("dcp", "il", "k", "p"),
    domain=lambda v: z3.And(v.dcp >= 1, v.il >= 1, v.k >= 1, v.p >= 0),
    definitions=lambda v: z3.And(
        _owner_defs(v, v.p, v.x, v.e, v.a, v.owner),
        divmod_def(v.p, v.k * v.il * v.dcp, v.q, v.m),
        divmod_def(v.m, v.il, v.y, v.f),
        divmod_def(v.y, v.dcp, v.b, v.vllm_owner),
    ),
    steps=(
        lambda v: v.x == v.q * v.k * v.dcp + v.y,
        lambda v: v.owner == v.vllm_owner,
    ),
    spec_values=lambda x: _vllm_values(x),
    samples=grid(**SMALL, k=range(1, 4), p=range(0, 20)),
)


def _vllm_values(x: dict[str, int]) -> dict[str, int]:
    q, m = divmod(x["p"], x["k"] * x["il"] * x["dcp"])
    y, f = divmod(m, x["il"])
    b, vllm_owner = divmod(y, x["dcp"])
    return _owner_values(x["p"], x["dcp"], x["il"]) | dict(q=q, m=m, y=y, f=f, b=b, vllm_owner=vllm_owner)


def _local_defs(v, s: str):
    """local_position(p, bs, dcp, il) with every division named (suffix ``s`` per position)."""
    n = {name: getattr(v, name + s) for name in ("p", "vb", "off", "g", "r", "t", "h", "local", "j", "hh")}
    return z3.And(
        v.bs == v.k * v.il,
        divmod_def(n["p"], v.bs * v.dcp, n["vb"], n["off"]),
        divmod_def(n["off"], v.il * v.dcp, n["g"], n["r"]),
        divmod_def(n["off"], v.il, n["t"], n["h"]),
        n["local"] == n["vb"] * v.bs + n["g"] * v.il + n["h"],
        # Not in the spec's formula: the run index inside the round (the owner, as proved).
        divmod_def(n["r"], v.il, n["j"], n["hh"]),
    )


def _local_values(p: int, k: int, dcp: int, il: int, s: str = "") -> dict[str, int]:
    bs = k * il
    vb, off = divmod(p, bs * dcp)
    g, r = divmod(off, il * dcp)
    t, h = divmod(off, il)
    j, hh = divmod(r, il)
    out = dict(vb=vb, off=off, g=g, r=r, t=t, h=h, j=j, hh=hh, local=local_position(p, bs, dcp, il))
    return {name + s: value for name, value in out.items()}


def _base_domain(v) -> z3.BoolRef:
    return z3.And(v.dcp >= 1, v.il >= 1, v.k >= 1)

SLOT_INDEX_SHARDED = Lemma(
    inputs=("dcp", "il", "k", "max_len", "p"),
    domain=lambda v: z3.And(_base_domain(v), 0 <= v.p, v.p < v.max_len),
    definitions=lambda v: z3.And(
        _local_defs(v, ""),
        divmod_def(v.local, v.bs, v.index, v.lo),  # slot_for_position reads row[local // bs]
        divmod_def(v.p, v.bs * v.dcp, v.tindex, v.toff),  # table_index, sharded
        divmod_def(-v.max_len, v.bs * v.dcp, v.nq, v.nr),
        v.width == -v.nq,  # max_num_blocks_per_req of a sharded group
    ),
    steps=(
        lambda v: v.g < v.k,
        lambda v: z3.And(0 <= v.local - v.vb * v.bs, v.local - v.vb * v.bs < v.bs),
        lambda v: v.index == v.vb,
        lambda v: v.vb * v.bs * v.dcp <= v.p,
        lambda v: v.vb < v.width,
        lambda v: z3.And(
            0 <= v.local - v.vb * v.bs, v.local - v.vb * v.bs < v.bs, v.index == v.tindex, v.index < v.width
        ),
    ),
    spec_values=lambda x: _slot_sharded_values(x),
    samples=grid(**SMALL, k=range(1, 3), max_len=(1, 9, 17), p=range(0, 17)),
)


def _slot_sharded_values(x: dict[str, int]) -> dict[str, int]:
    k, il, dcp, p, max_len = x["k"], x["il"], x["dcp"], x["p"], x["max_len"]
    bs = k * il
    out = _local_values(p, k, dcp, il) | {"bs": bs}
    out["index"], out["lo"] = divmod(out["local"], bs)
    out["tindex"], out["toff"] = table_index(p, bs, dcp, True), p % (bs * dcp)
    out["nq"], out["nr"] = divmod(-max_len, bs * dcp)
    out["width"] = max_num_blocks_per_req(CacheGroup(GroupKind.FULL_ATTENTION, bs), dcp, max_len)
    return out


SLOT_INDEX_REPLICATED = Lemma(
    inputs=("dcp", "bs", "sp", "max_len", "p"),
    domain=lambda v: z3.And(v.dcp >= 1, v.bs >= 1, v.sp >= 0, 0 <= v.p, v.p < v.max_len),
    definitions=lambda v: z3.And(
        divmod_def(v.p, v.bs, v.index, v.lo),  # replicated: slot_for_position reads row[p // bs]
        divmod_def(-v.max_len, v.bs, v.nq, v.nr),
        v.width == -v.nq + v.sp,  # max_num_blocks_per_req of an align-mode Mamba group
    ),
    steps=(lambda v: v.index * v.bs <= v.p, lambda v: v.index < v.width),
    spec_values=lambda x: {
        "index": table_index(x["p"], x["bs"], x["dcp"], False),
        "lo": x["p"] % x["bs"],
        **dict(zip(("nq", "nr"), divmod(-x["max_len"], x["bs"]))),
        "width": max_num_blocks_per_req(
            CacheGroup(GroupKind.MAMBA, x["bs"], num_speculative_blocks=x["sp"]), x["dcp"], x["max_len"]
        ),
    },
    samples=grid(dcp=range(1, 4), bs=range(1, 5), sp=range(0, 2), max_len=range(1, 20, 3), p=range(0, 20)),
)


# Every position is a mixed-radix number: p = ((m * dcp + owner) * il + h) with h < il,
# owner < dcp, and its local position is m * il + h. LOCAL_DIGITS proves that of the spec's
# formulas (one position); LOCAL_ORDER proves, on digits alone, that two positions of one
# owner keep their order locally. Together: local_position is strictly increasing per rank,
# hence injective, and with the row's block ids distinct (a pool hands out distinct ids) the
# slots row[local // bs] * bs + local % bs of one rank are distinct.
LOCAL_DIGITS = Lemma(
    inputs=("dcp", "il", "k", "p"),
    domain=lambda v: z3.And(_base_domain(v), 0 <= v.p),
    definitions=lambda v: z3.And(_local_defs(v, ""), _owner_defs(v, v.p, v.x, v.e, v.a, v.owner)),
    steps=(
        lambda v: v.hh == v.h,
        lambda v: v.p == v.vb * v.bs * v.dcp + v.g * v.il * v.dcp + v.j * v.il + v.h,
        lambda v: v.x == (v.vb * v.k + v.g) * v.dcp + v.j,
        lambda v: v.owner == v.j,
        lambda v: z3.And(
            v.p == ((v.vb * v.k + v.g) * v.dcp + v.owner) * v.il + v.h,
            v.local == (v.vb * v.k + v.g) * v.il + v.h,
            0 <= v.h, v.h < v.il, 0 <= v.owner, v.owner < v.dcp, v.vb * v.k + v.g >= 0,
        ),
    ),
    spec_values=lambda x: _local_values(x["p"], x["k"], x["dcp"], x["il"])
    | _owner_values(x["p"], x["dcp"], x["il"])
    | {"bs": x["k"] * x["il"]},
    samples=grid(**SMALL, k=range(1, 3), p=range(0, 30)),
)

LOCAL_ORDER = Lemma(
    inputs=("dcp", "il", "o", "m1", "h1", "m2", "h2"),
    domain=lambda v: z3.And(
        v.dcp >= 1, v.il >= 1, 0 <= v.o, v.o < v.dcp, v.m1 >= 0, v.m2 >= 0,
        0 <= v.h1, v.h1 < v.il, 0 <= v.h2, v.h2 < v.il,
        (v.m1 * v.dcp + v.o) * v.il + v.h1 < (v.m2 * v.dcp + v.o) * v.il + v.h2,
    ),
    definitions=lambda v: z3.BoolVal(True),  # digits only: nothing of the spec to mirror
    steps=(lambda v: v.m1 <= v.m2, lambda v: v.m1 * v.il + v.h1 < v.m2 * v.il + v.h2),
    spec_values=lambda x: {},
    samples=grid(),
)


def _lsl_defs(v, n, fr, rest, r, lsl):
    """local_seq_len(n, r, dcp, il) == fr * il + clamp(rest - r * il, 0, il)."""
    return z3.And(divmod_def(n, v.dcp * v.il, fr, rest), lsl == fr * v.il + clamp(rest - r * v.il, 0, v.il))


def _lsl_values(n: int, r: int, dcp: int, il: int, s: str = "") -> dict[str, int]:
    fr, rest = divmod(n, dcp * il)
    return {f"fr{s}": fr, f"rest{s}": rest, f"lsl{s}": local_seq_len(n, r, dcp, il)}


# The induction step of "local_seq_len(n, r) counts the positions < n that rank r owns":
# appending position n adds one to its owner's length and nothing to any other rank's. With
# local_seq_len(0, r) == 0 this proves the count for every n by induction, and the sum over
# ranks equals n because each position has exactly one owner (LEM-OWNER-UNIQUE).
LOCAL_LEN_COUNT = Lemma(
    inputs=("dcp", "il", "r", "n"),
    domain=lambda v: z3.And(v.dcp >= 1, v.il >= 1, 0 <= v.r, v.r < v.dcp, v.n >= 0),
    definitions=lambda v: z3.And(
        _lsl_defs(v, v.n, v.fr, v.rest, v.r, v.lsl),
        _lsl_defs(v, v.n + 1, v.frb, v.restb, v.r, v.lslb),
        _owner_defs(v, v.n, v.x, v.e, v.a, v.owner),
        divmod_def(v.rest, v.il, v.j, v.hh),
    ),
    steps=(
        lambda v: v.n == (v.fr * v.dcp + v.j) * v.il + v.hh,
        lambda v: v.x == v.fr * v.dcp + v.j,
        lambda v: v.owner == v.j,
        lambda v: z3.If(
            v.rest == v.dcp * v.il - 1,
            z3.And(v.frb == v.fr + 1, v.restb == 0),
            z3.And(v.frb == v.fr, v.restb == v.rest + 1),
        ),
        lambda v: z3.And(
            v.lslb - v.lsl == z3.If(v.owner == v.r, 1, 0), z3.Implies(v.n == 0, v.lsl == 0)
        ),
    ),
    spec_values=lambda x: _lsl_values(x["n"], x["r"], x["dcp"], x["il"])
    | _lsl_values(x["n"] + 1, x["r"], x["dcp"], x["il"], "b")
    | _owner_values(x["n"], x["dcp"], x["il"])
    | dict(zip(("j", "hh"), divmod(x["n"] % (x["dcp"] * x["il"]), x["il"]))),
    samples=grid(**SMALL, r=range(0, 4), n=range(0, 16)),
)

LOCAL_LEN_BOUND_BALANCE = Lemma(
    inputs=("dcp", "il", "n", "r1", "r2"),
    domain=lambda v: z3.And(v.dcp >= 1, v.il >= 1, v.n >= 0, 0 <= v.r1, v.r1 < v.r2, v.r2 < v.dcp),
    definitions=lambda v: z3.And(
        _lsl_defs(v, v.n, v.fr, v.rest, v.r1, v.lsl1),
        _lsl_defs(v, v.n, v.fr, v.rest, v.r2, v.lsl2),
        divmod_def(-v.n, v.dcp * v.il, v.nq, v.nr),
        v.cap == -v.nq * v.il,  # cdiv(n, dcp * il) * il
    ),
    steps=(
        lambda v: v.r1 * v.il + v.il <= v.r2 * v.il,
        lambda v: z3.Or(v.rest == 0, v.nq == -v.fr - 1),
        lambda v: v.lsl1 <= v.cap,
        lambda v: v.lsl1 >= v.lsl2,
        lambda v: z3.And(v.lsl1 <= v.cap, v.lsl2 <= v.cap, v.lsl1 >= v.lsl2, v.lsl1 - v.lsl2 <= v.il),
    ),
    spec_values=lambda x: _lsl_values(x["n"], x["r1"], x["dcp"], x["il"], "1")
    | _lsl_values(x["n"], x["r2"], x["dcp"], x["il"], "2")
    | {"fr": x["n"] // (x["dcp"] * x["il"]), "rest": x["n"] % (x["dcp"] * x["il"])}
    | dict(zip(("nq", "nr"), divmod(-x["n"], x["dcp"] * x["il"])))
    | {"cap": cdiv(x["n"], x["dcp"] * x["il"]) * x["il"]},
    samples=grid(**SMALL, n=range(0, 16), r1=range(0, 3), r2=range(1, 4)),
)

OBLIGATIONS = (
    lemma_obligation(
        "LEM-OWNER-UNIQUE", ("INV-DCP-OWNER-RANGE", "INV-DCP-OWNER-UNIQUE"),
        "every sharded position is owned by exactly one rank in [0, dcp)", OWNER_UNIQUE,
    ),
    lemma_obligation(
        "LEM-OWNER-VLLM", ("INV-DCP-OWNER-RANGE",),
        "owner (p // I) % D equals vLLM's ((p % (bs*D)) // I) % D when I | bs", OWNER_MATCHES_VLLM,
    ),
    lemma_obligation(
        "LEM-SLOT-INDEX-SHARDED", ("INV-SLOT-INDEX-BOUND", "INV-SLOT-TABLE-INDEX", "INV-DCP-LOCAL-IN-BLOCK"),
        "sharded: local offset inside the local page, index read == p // (bs*D) < width when p < L <= max_len",
        SLOT_INDEX_SHARDED,
    ),
    lemma_obligation(
        "LEM-SLOT-INDEX-REPLICATED", ("INV-SLOT-INDEX-BOUND", "INV-SLOT-TABLE-INDEX"),
        "replicated: index read p // bs < cdiv(max_len, bs) + Sp when p < L <= max_len", SLOT_INDEX_REPLICATED,
    ),
    lemma_obligation(
        "LEM-LOCAL-INJECTIVE", ("INV-DCP-SLOT-DISTINCT",),
        "local_position is strictly increasing per rank (so one rank's slots are distinct)",
        LOCAL_DIGITS, LOCAL_ORDER,
    ),
    lemma_obligation(
        "LEM-LOCAL-LEN-COUNT", ("INV-DCP-LOCAL-LEN-SUM",),
        "local_seq_len counts the owned positions (induction step), hence the lengths sum to L",
        LOCAL_LEN_COUNT,
    ),
    lemma_obligation(
        "LEM-LOCAL-LEN-BOUND", ("INV-DCP-LOCAL-LEN-BOUND", "INV-DCP-LOCAL-LEN-BALANCE"),
        "local lengths are <= cdiv(L, D*I)*I, non-increasing by rank and differ by at most I",
        LOCAL_LEN_BOUND_BALANCE,
    ),
)
