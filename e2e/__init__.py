"""End to end: a tiny hybrid model served through kvproof's scheduler, block tables and slot
mappings on real DCP ranks, compared with recomputation (docs/e2e.md)."""

from kvproof.e2e.faults import Faults
from kvproof.e2e.runner import TOLERANCE, E2EOptions, E2EResult, run_e2e

__all__ = ["E2EOptions", "E2EResult", "Faults", "TOLERANCE", "run_e2e"]
