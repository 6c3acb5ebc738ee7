"""Proof obligations over the spec: z3 lemmas, CrossHair runs, exhaustive small-scope checks,
and canaries (seeded bugs that must be refuted). See proofs/README.md and docs/proofs.md;
``kvproof prove`` runs them all."""
