"""Test-wide settings: slow-tier contracts on, Hypothesis profiles without deadlines
(timing belongs in benchmarks, and CI machines are shared)."""

from __future__ import annotations

import os

# Before any kvproof module is imported: whole-state (slow-tier) checks run in tests.
os.environ.setdefault("ICONTRACT_SLOW", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("thorough", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
