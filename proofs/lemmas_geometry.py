"""z3 lemma: with partial hits on, every hit boundary falls on both groups' hash grids.

The spec side is checked on the real functions by EXH-LAYOUT (proofs/geometry.py): H divides
every prefix-cacheable effective block (INV-GEOM-HASH-DIVIDES, INV-GEOM-PARTIAL-GRID) and hits
land on multiples of A = H (INV-GEOM-HIT-ALIGN). This lemma takes those as hypotheses
(B_a = xa*H, B_m = xm*H, N = n*H) and proves, for all integers, what the one-key design
(docs: "One key for every cached thing") needs from them: a hit at N ends, inside each
group's block, on a whole number of hash blocks -- so the group's partial key (N, group)
exists -- and where a block is exactly one hash block (a Mamba block == H under DCP, or a
coarse-lookup group) the hit is on that group's block boundary.
"""

from __future__ import annotations

import z3

from kvproof.proofs.z3kit import Lemma, divmod_def, grid, lemma_obligation


def _grid_values(x: dict[str, int]) -> dict[str, int]:
    out = {}
    for g in ("a", "m"):
        out[f"q{g}"], out[f"o{g}"] = divmod(x["n"] * x["H"], x[f"x{g}"] * x["H"])
    return out


def _on_hash_grid(v, q, o, xb):
    return z3.And(o == (v.n - q * xb) * v.H, 0 <= v.n - q * xb, v.n - q * xb < xb)


PARTIAL_GRID = Lemma(
    inputs=("H", "xa", "xm", "n"),
    domain=lambda v: z3.And(v.H >= 1, v.xa >= 1, v.xm >= 1, v.n >= 0),
    definitions=lambda v: z3.And(
        divmod_def(v.n * v.H, v.xa * v.H, v.qa, v.oa),  # offset of the hit inside the attention block
        divmod_def(v.n * v.H, v.xm * v.H, v.qm, v.om),  # ... inside the Mamba block
    ),
    steps=(
        lambda v: _on_hash_grid(v, v.qa, v.oa, v.xa),
        lambda v: _on_hash_grid(v, v.qm, v.om, v.xm),
        lambda v: z3.And(
            _on_hash_grid(v, v.qa, v.oa, v.xa),
            _on_hash_grid(v, v.qm, v.om, v.xm),
            z3.Implies(v.xm == 1, v.om == 0),
            z3.Implies(v.xa == 1, v.oa == 0),
        ),
    ),
    spec_values=_grid_values,
    samples=grid(H=range(1, 5), xa=range(1, 4), xm=range(1, 4), n=range(0, 10)),
)

OBLIGATIONS = (
    lemma_obligation(
        "LEM-PARTIAL-GRID", ("INV-GEOM-PARTIAL-GRID", "INV-GEOM-HIT-ALIGN"),
        "H | B_a, H | B_m and N = n*H put N on both groups' hash grids (on the block grid where B == H)",
        PARTIAL_GRID,
    ),
)
