"""Test-wide settings: slow-tier contracts on, Hypothesis profiles without deadlines
(timing belongs in benchmarks, and CI machines are shared).

``HYPOTHESIS_PROFILE=thorough`` raises every property test and state machine to at least the
profile's example count, also those that fix ``max_examples`` for the everyday run (Hypothesis
itself lets such a test's own setting win over the profile); ``mutation`` (tools/mutation.py)
caps every one at its count, derandomized, so that a mutant's verdict is repeatable; ``random``
(CI's random-seed pass, docs/testing.md) runs only the property tests and state machines, capped
at its count, from ``--hypothesis-seed`` (or a fresh seed), and prints the seed first and, for
each failure, the command that reproduces it.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest

# Before any kvproof module is imported: whole-state (slow-tier) checks run in tests.
os.environ.setdefault("ICONTRACT_SLOW", "1")
# vLLM picks its platform once, when a vLLM module first asks: the CPU platform must be chosen
# before any test folder (tests/plan, tests/vllm, ...) imports one.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from hypothesis import HealthCheck, event, settings  # noqa: E402

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("thorough", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "mutation", deadline=None, max_examples=30, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile("random", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
settings.load_profile(PROFILE)


def pin_local_constants() -> bool:
    """Make a derandomized run draw the same cases in every process. Hypothesis (6.131 and
    later) mixes literals from every local module in ``sys.modules`` into what it generates, so
    a fixed seed reached different cases depending on which modules earlier tests in the same
    process had imported: a state machine's reach floor held alone and failed in one CI worker.
    Derandomized profiles draw from Hypothesis's own constants only; the pool Hypothesis would
    have used stays reachable as ``providers._get_local_constants.unpinned``. Returns whether
    there was a pool to pin (older Hypothesis has none)."""
    from hypothesis.internal.conjecture import providers

    current = getattr(providers, "_get_local_constants", None)
    if current is None:
        return False
    if not hasattr(current, "unpinned"):
        def pinned():
            return providers.Constants()

        pinned.unpinned = current
        providers._get_local_constants = pinned
    return True


if settings.get_profile(PROFILE).derandomize:
    pin_local_constants()


def is_property_test(item) -> bool:
    """Whether ``item`` is a Hypothesis test: an ``@given`` function or a state machine's case."""
    fn = getattr(item, "obj", None)
    cls = getattr(item, "cls", None)
    return (fn is not None and hasattr(fn, "_hypothesis_internal_use_settings")) or (
        cls is not None and isinstance(getattr(cls, "settings", None), settings)
    )


def apply_profile(items, examples: int, at_least: bool) -> list[tuple[str, int]]:
    """Give every Hypothesis test among ``items`` at least (``at_least``) or at most ``examples``
    examples, with the loaded profile's other settings; returns ``(test id, max_examples)`` for
    each. Mutates the tests' settings."""
    pick = max if at_least else min
    profile = settings.default
    out = []
    for item in items:
        fn = getattr(item, "obj", None)
        cls = getattr(item, "cls", None)
        if fn is not None and hasattr(fn, "_hypothesis_internal_use_settings"):
            own = fn._hypothesis_internal_use_settings
            fn._hypothesis_internal_use_settings = settings(
                own, max_examples=pick(own.max_examples, examples), derandomize=profile.derandomize, database=profile.database,
            )
            out.append((item.nodeid, fn._hypothesis_internal_use_settings.max_examples))
        elif cls is not None and isinstance(getattr(cls, "settings", None), settings):  # a state machine's TestCase
            cls.settings = settings(
                cls.settings, max_examples=pick(cls.settings.max_examples, examples), derandomize=profile.derandomize,
                database=profile.database,
            )
            out.append((item.nodeid, cls.settings.max_examples))
    return out


def pytest_collection_modifyitems(config, items):
    if PROFILE == "random":
        keep = [item for item in items if is_property_test(item)]
        config.hook.pytest_deselected(items=[item for item in items if not is_property_test(item)])
        items[:] = keep
    if PROFILE not in ("thorough", "mutation", "random"):
        return
    reached = apply_profile(items, settings.get_profile(PROFILE).max_examples, at_least=PROFILE == "thorough")
    report = os.environ.get("KVPROOF_PROFILE_REPORT")
    if report:  # tests/spec/test_contracts.py reads which tests the profile reached
        with open(report, "w") as f:
            f.writelines(f"{nodeid}\t{n}\n" for nodeid, n in reached)


def _seed(config) -> str | None:
    seed = config.getoption("hypothesis_seed", None)
    return None if seed is None else str(seed)


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's plugin reads the option
def pytest_configure(config):
    # The random pass draws one seed for the whole run (every xdist worker gets the same one),
    # so the command that reproduces a failure is known before anything runs.
    if PROFILE == "random" and _seed(config) is None:
        import secrets

        # Drawn by the controller; its xdist workers, started later, inherit the variable.
        os.environ.setdefault("KVPROOF_RANDOM_SEED", str(secrets.randbelow(2**32)))
        config.option.hypothesis_seed = int(os.environ["KVPROOF_RANDOM_SEED"])


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if PROFILE == "random" and reporter is not None:  # the controller (xdist workers have none)
        reporter.write_line(
            f"random-seed pass: --hypothesis-seed={_seed(session.config)} (HYPOTHESIS_PROFILE=random, at most "
            f"{settings.default.max_examples} examples per property test)"
        )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if PROFILE != "random":
        return
    failed = [r.nodeid for r in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])]
    for nodeid in failed:
        terminalreporter.write_line(
            f"reproduce: HYPOTHESIS_PROFILE=random python -m pytest -p no:cacheprovider --hypothesis-seed={_seed(config)} '{nodeid}'"
        )


#: ``KVPROOF_CLI``: the path of an installed ``kvproof`` command (CI sets it to the README's
#: wheel install) that the docs' example tests run instead of this checkout's code.
INSTALLED_CLI = os.environ.get("KVPROOF_CLI") or None


def kvproof_command() -> list[str]:
    """The argv prefix that runs ``kvproof``: the installed command named by ``KVPROOF_CLI``, else
    this checkout's through the current interpreter."""
    return [INSTALLED_CLI] if INSTALLED_CLI else [sys.executable, "-m", "kvproof.cli.main"]


class Reach:
    """What a property test's generated cases reached: ``reach(label)`` counts a case (and
    records it as a ``hypothesis.event``); ``reach.minimums`` is what a fixed-seed run must
    reach, checked after the test's last example."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.minimums: dict[str, int] = {}

    def __call__(self, label: str) -> None:
        self.counts[label] += 1
        event(label)

    def shortfall(self) -> dict[str, tuple[int, int]]:
        return {k: (self.counts[k], m) for k, m in self.minimums.items() if self.counts[k] < m}


#: Hypothesis reuses function-scoped fixtures across a test's examples, as ``reach`` wants.
REACH_SETTINGS = dict(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def reach():
    """Fails a fixed-seed run (the ``ci`` profile, derandomized) whose cases fall short of
    ``reach.minimums``; other profiles' runs (random, or the mutation profile's few examples)
    only record what they reached."""
    r = Reach()
    yield r
    if PROFILE == "ci":
        assert not r.shortfall(), f"generated cases reached too few: {r.shortfall()} of {dict(r.counts)}"
