"""CrossHair over the spec's icontract contracts (``crosshair check --analysis_kind=icontract``).

CrossHair executes the spec symbolically: ``@require`` are assumptions, ``@ensure`` are
obligations. Per condition it answers "confirmed over all paths" (every path explored: a proof
for Python's semantics), "not confirmed" (its per-condition time ran out) or an error line
naming a call. Verdicts:

* ``proved``: every condition of every target confirmed over all paths;
* ``timeout``: some condition not confirmed within its time, or the run passed the deadline;
* ``refuted``: an error line whose call, replayed concretely here, breaks the condition the line
  names (or raises the exception it names); the replay is the counterexample;
* ``error``: anything else -- an error line that does not replay (CrossHair's own failures,
  e.g. a ``RecursionError`` inside its symbolic run, or ``NotDeterministic``), a crash, no output.

The per-condition time is fixed per obligation, not taken from the budget, so the verdict does
not depend on ``--budget``; the budget is only a deadline for the subprocess.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import signal
import subprocess
import sys
import time
from typing import Callable

import icontract._checkers as _checkers  # find_checker: the documented way to read contracts back

from kvproof.proofs.crosshair_targets import MAX_DCP
from kvproof.proofs.registry import ERROR, PROVED, REFUTED, TIMEOUT, Obligation, Outcome

_LINE = re.compile(r"^(?P<path>[^:\n]+):(?P<line>\d+): (?P<level>error|info): (?P<message>.*)$")
_CALL = re.compile(r"when calling (?P<name>\w+)\(")
_EXCEPTION = re.compile(r"^(?P<type>\w+(?:Error|Exception)): ")


def _die_with_parent() -> None:
    """In the child before exec: receive SIGKILL when the parent dies (Linux), so a killed
    ``kvproof prove`` never leaves CrossHair running."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's finally still kills the child
        pass


def run_crosshair(targets: tuple[str, ...], per_condition: float, deadline_seconds: float) -> Outcome:
    """Check each of ``targets`` (importable names) in its own CrossHair process, with
    ``per_condition`` CPU seconds per condition, all within ``deadline_seconds`` of wall time.

    One process per target: analysed together, CrossHair left conditions unconfirmed that it
    confirms in seconds alone. The first verdict other than ``proved`` is the obligation's."""
    deadline = time.monotonic() + deadline_seconds
    confirmed = 0
    for target in targets:
        outcome = _run_one(target, per_condition, deadline - time.monotonic())
        if outcome.verdict != PROVED:
            return outcome
        confirmed += int(outcome.detail.split()[0])
    return Outcome(PROVED, detail=f"{confirmed} conditions of {len(targets)} targets confirmed over all paths")


def _run_one(target: str, per_condition: float, seconds_left: float) -> Outcome:
    if seconds_left <= 0:
        return Outcome(TIMEOUT, detail=f"{target}: not started, the budget was spent")
    cmd = [
        sys.executable, "-m", "crosshair", "check", "--analysis_kind=icontract", "--report_all",
        f"--per_condition_timeout={per_condition:.1f}", target,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent,
    )
    try:
        stdout, stderr = proc.communicate(timeout=seconds_left)
    except subprocess.TimeoutExpired:
        return Outcome(TIMEOUT, detail=f"{target}: crosshair did not finish within the {seconds_left:.0f}s left of the budget")
    finally:
        if proc.poll() is None:  # a timeout, or an exception (Ctrl-C) while waiting
            proc.kill()
            proc.wait()
    return verdict_from_output((target,), stdout, stderr, proc.returncode, per_condition)


def verdict_from_output(targets: tuple[str, ...], stdout: str, stderr: str, returncode: int, per_condition: float) -> Outcome:
    """The verdict for one CrossHair run's output (see the module docstring)."""
    results = [m for m in map(_LINE.match, stdout.splitlines()) if m]
    errors = [m for m in results if m["level"] == "error"]
    if not results:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return Outcome(ERROR, detail=f"crosshair exited {returncode} with no verdict: {tail}")
    refutations, tool_failures = [], []
    for m in errors:
        replayed = replay(targets, m["path"], int(m["line"]), m["message"])
        (refutations if replayed.verdict == REFUTED else tool_failures).append(replayed)
    if refutations:
        return Outcome(REFUTED, counterexample="; ".join(o.counterexample for o in refutations))
    if tool_failures:
        return Outcome(ERROR, detail="; ".join(o.detail for o in tool_failures))
    infos = [m for m in results if m["level"] == "info"]
    confirmed = sum(1 for m in infos if m["message"].startswith("Confirmed over all paths"))
    if confirmed == len(infos):
        return Outcome(PROVED, detail=f"{confirmed} conditions confirmed over all paths")  # run_crosshair reads the count
    open_ = [f"{_short_path(m['path'])}:{m['line']}" for m in infos if not m["message"].startswith("Confirmed")]
    return Outcome(
        TIMEOUT,
        detail=f"{len(open_)} of {len(infos)} conditions not confirmed within {per_condition:.0f}s each: {', '.join(open_)}",
    )


def _short_path(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


# --- replaying a reported call ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    args: tuple
    kwargs: dict


def _capture(*args, **kwargs) -> _Call:
    return _Call(args, kwargs)


def _target_functions(targets: tuple[str, ...]) -> dict[str, Callable]:
    """Every contract-carrying function the targets name, by ``__name__`` (as CrossHair prints it)."""
    out: dict[str, Callable] = {}
    for target in targets:
        try:
            obj = importlib.import_module(target)
        except ImportError:
            module, _, attr = target.rpartition(".")
            obj = getattr(importlib.import_module(module), attr)
        candidates = vars(obj).values() if inspect.ismodule(obj) else (obj,)
        for fn in candidates:
            if callable(fn) and _checkers.find_checker(fn) is not None:
                out.setdefault(fn.__name__, fn)
    return out


def replay(targets: tuple[str, ...], path: str, line: int, message: str) -> Outcome:
    """Run the call an error line names, concretely, and say whether it breaks the condition the
    line points at (``refuted``) or not (``error``: CrossHair's report does not hold up)."""
    said = f"crosshair reported {_short_path(path)}:{line}: {message}"
    call_match = _CALL.search(message)
    args = _balanced(message, call_match.end()) if call_match else None
    if args is None:
        return Outcome(ERROR, detail=f"{said} (names no call to replay)")
    fn = _target_functions(targets).get(call_match["name"])
    if fn is None:
        return Outcome(ERROR, detail=f"{said} (no target is named {call_match['name']})")
    namespace = dict(vars(inspect.getmodule(inspect.unwrap(fn)) or sys.modules[fn.__module__]))
    namespace.update(vars(sys.modules[fn.__module__]))
    namespace["_capture"] = _capture
    try:
        call = eval(compile(ast.parse(f"_capture({args})", mode="eval"), "<crosshair call>", "eval"), namespace)
    except Exception as e:  # CrossHair printed arguments that do not read back
        return Outcome(ERROR, detail=f"{said} (its arguments do not evaluate: {type(e).__name__}: {e})")
    return _replay_call(fn, call, f"{fn.__name__}({args})", path, line, message, said)


def _balanced(text: str, start: int) -> str | None:
    """The text from ``start`` up to the parenthesis that closes the one just before it."""
    depth, quote, i = 1, None, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _replay_call(fn: Callable, call: _Call, shown: str, path: str, line: int, message: str, said: str) -> Outcome:
    checker = _checkers.find_checker(fn)
    bound = inspect.signature(fn).bind(*call.args, **call.kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for group in checker.__preconditions__:
        for contract in group:
            if not _condition_holds(contract, arguments):
                return Outcome(ERROR, detail=f"{said} (the call breaks a precondition, so it is not in the domain)")
    bare = inspect.unwrap(fn)
    expected = _EXCEPTION.match(message)
    try:
        result = bare(*call.args, **call.kwargs)
    except Exception as e:
        if expected and type(e).__name__ == expected["type"]:
            return Outcome(REFUTED, counterexample=f"{shown} raises {type(e).__name__}: {e}")
        return Outcome(ERROR, detail=f"{said} (the replay raises {type(e).__name__}: {e} instead)")
    if expected is None:
        broken = [
            c for c in checker.__postconditions__
            if _names(c.condition, path, line, message) and not _condition_holds(c, {**arguments, "result": result})
        ]
        if broken:
            return Outcome(
                REFUTED,
                counterexample=f"when calling {shown} (which returns {result!r}): breaks {broken[0].description or 'the condition'}",
            )
    return Outcome(ERROR, detail=f"{said} (the replay returns {result!r} and meets the condition)")


def _condition_holds(contract, arguments: dict) -> bool:
    wanted = inspect.signature(contract.condition).parameters
    return bool(contract.condition(**{name: arguments[name] for name in wanted if name in arguments}))


def _names(condition: Callable, path: str, line: int, message: str) -> bool:
    """Whether CrossHair's report names ``condition``: its ``path:line`` lies in a lambda's source,
    or the message quotes a named condition's ``def`` line."""
    code = getattr(condition, "__code__", None)
    if code is None:
        return False
    if condition.__name__ != "<lambda>":
        return f"def {condition.__name__}(" in message
    if code.co_filename != path:
        return False
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return min(lines + [code.co_firstlineno]) <= line <= max(lines + [code.co_firstlineno])


def crosshair_obligation(
    id: str, invariants: tuple[str, ...], statement: str, targets: tuple[str, ...], per_condition: float
) -> Obligation:
    return Obligation(
        id, invariants, "crosshair", statement,
        lambda budget: run_crosshair(targets, per_condition, budget),
    )


_T = "kvproof.proofs.crosshair_targets."

OBLIGATIONS = (
    crosshair_obligation(
        "CH-ARITH", ("INV-ARITH-CDIV", "INV-ARITH-FLOOR"),
        "cdiv and floor_to meet their postconditions", ("kvproof.spec.arith",), per_condition=20.0,
    ),
    crosshair_obligation(
        "CH-PLACEMENT",
        ("INV-DCP-OWNER-RANGE", "INV-DCP-LOCAL-IN-BLOCK", "INV-DCP-LOCAL-LEN-BOUND", "INV-DCP-LOCAL-LEN-SUM",
         "INV-DCP-LOCAL-LEN-BALANCE", "INV-SLOT-TABLE-INDEX"),
        f"owner_rank, local_position and local_seq_len (all inputs), table_index and local_seq_lens "
        f"(DCP <= {MAX_DCP}) meet their postconditions",
        (
            "kvproof.spec.placement.owner_rank", "kvproof.spec.placement.local_position",
            "kvproof.spec.placement.local_seq_len", _T + "table_index", _T + "local_seq_lens",
        ),
        per_condition=60.0,
    ),
    crosshair_obligation(
        "CANARY-CH-MAMBA-WIDTH", ("INV-TABLE-WIDTH",),
        "CrossHair finds the old Mamba width rule (divided by DCP) against max_num_blocks_per_req's contract",
        # CrossHair's per-path timeout grows with the per-condition one and changes which
        # counterexample it meets first; the golden file pins the one found at 60 s (~20 s in).
        (_T + "old_max_num_blocks_per_req",), per_condition=60.0,
    ),
)
