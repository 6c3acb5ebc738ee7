"""The recommendation: one configuration for a stated objective within a stated GPU budget, and
the ``vllm serve`` command that runs it (docs/plan.md, "Recommendations and diagnoses").

GPUs are counted as vLLM deploys them: decode context parallelism reuses the tensor-parallel
ranks (vLLM 0.33.0's ``ParallelConfig``: ``tp_size`` must be divisible by ``dcp_size``), so a
model served on TP GPUs takes TP GPUs at every DCP size that divides TP, and a DCP size that
does not divide TP cannot be served. When the bytes were given by hand, the TP they assume is
unknown and a DCP size is counted at its least deployment, DCP GPUs.

Objectives:

* ``hit-rate``: the most prompt tokens from cache over every memory size tried; configurations
  within KNEE_POINTS of it are named beside it, and with a sweep the least memory that stays
  within KNEE_POINTS, or, when the best is the largest size tried and the rate still rises
  there, that it does.
* ``per-gpu``: the most cached tokens per GiB of KV memory over the deployment's GPUs, across the
  stated memory and the sweep.
* ``target-hit=X``: the least KV memory over the deployment's GPUs whose hit rate reaches X.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvproof.planner.memory import gib
from kvproof.planner.run import ConfigReport

OBJECTIVES = ("hit-rate", "per-gpu", "target-hit=X")
#: Configurations within this many points of the best count as as good (named beside it), and
#: a memory size within this many points of the largest one's rate reaches it.
KNEE_POINTS = 0.01


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str  # "hit-rate", "per-gpu" or "target-hit"
    target: Optional[float] = None  # target-hit: the hit rate to reach, a fraction

    @classmethod
    def parse(cls, text: str) -> "Objective":
        """``hit-rate``, ``per-gpu`` or ``target-hit=X`` (X a percentage or a fraction below 1)."""
        if text in ("hit-rate", "per-gpu"):
            return cls(text)
        name, _, value = text.partition("=")
        if name == "target-hit" and value:
            try:
                x = float(value.removesuffix("%"))
            except ValueError:
                x = -1.0
            fraction = x / 100 if (value.endswith("%") or x >= 1) else x
            if 0 < fraction <= 1:
                return cls("target-hit", fraction)
        raise ValueError(
            f"--objective {text!r} must be one of {', '.join(OBJECTIVES)} "
            "(X a hit rate: a percentage such as 20 or 20%, or a fraction such as 0.2)"
        )

    def label(self) -> str:
        return f"target-hit {100 * self.target:g} %" if self.name == "target-hit" else self.name


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What the plan knows of how the model is served."""

    #: GPUs each layer is split over; None when the byte figures were given by hand.
    tensor_parallel_size: Optional[int]
    #: The operator's budget (``--gpus``); None for no limit.
    gpu_budget: Optional[int] = None

    def gpus(self, dcp: int) -> int:
        return self.tensor_parallel_size if self.tensor_parallel_size is not None else dcp

    def servable(self, dcp: int) -> bool:
        tp = self.tensor_parallel_size
        return (tp is None or tp % dcp == 0) and (self.gpu_budget is None or self.gpus(dcp) <= self.gpu_budget)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _memory(r: ConfigReport) -> float:
    """KV memory per GPU in GiB (the pool's bytes when it was given in blocks)."""
    return gib(r.kv_memory_bytes if r.kv_memory_bytes is not None else r.num_blocks * r.block_bytes)


def _name(r: ConfigReport, several_policies: bool, several_blocks: bool = False) -> str:
    return (f"DCP {r.dcp}" + (f" block {r.block_size}" if several_blocks else "")
            + (f" (eviction {r.eviction})" if several_policies else ""))


def _line(r: ConfigReport) -> tuple:
    """What names a configuration apart from its memory size."""
    return r.dcp, r.eviction, r.block_size or 0


def _still_rising(r: ConfigReport, sweep: list[ConfigReport]) -> bool:
    """Whether ``r`` is at the largest memory its DCP size and policy tried, with the rate still
    climbing by more than KNEE_POINTS from the size below."""
    line = sorted((p for p in sweep if _line(p) == _line(r) and not p.violations), key=_memory)
    return len(line) > 1 and line[-1] is r and r.hit_rate - line[-2].hit_rate > KNEE_POINTS


def _best(reports: list[ConfigReport]) -> ConfigReport:
    """The highest hit rate; on a tie the less memory, then the smaller DCP size."""
    return max(reports, key=lambda r: (r.hit_rate, -_memory(r), -r.dcp))


def recommend(reports: list[ConfigReport], sweep: list[ConfigReport], objective: Objective, deployment: Deployment) -> dict:
    """The choice for ``objective`` among the clean, servable configurations (the stated memory
    in ``reports``; every memory in ``sweep``, which includes them). JSON-ready; ``text`` is one line."""
    points = sweep or reports
    clean = [r for r in points if not r.violations and deployment.servable(r.dcp)]
    several = len({r.eviction for r in points}) > 1
    blocks = len({r.block_size for r in points}) > 1
    out: dict = {"objective": objective.label()}
    if not clean:
        why = "no configuration ran cleanly" if all(r.violations for r in points) else (
            f"no DCP size fits: TP {deployment.tensor_parallel_size} must be divisible by it"
            + (f" within {deployment.gpu_budget} GPUs" if deployment.gpu_budget is not None else "")
        )
        return {**out, "choice": None, "text": why}
    notes: list[str] = []
    if objective.name == "hit-rate":
        choice = _best(clean)
        if _still_rising(choice, sweep):
            notes.append(f"still rising at {_memory(choice):.4g} GiB per GPU, the largest tried: sweep larger sizes")
        elif sweep:
            line = sorted((p for p in clean if _line(p) == _line(choice)), key=_memory)
            knee = next(p for p in line if p.hit_rate >= choice.hit_rate - KNEE_POINTS)
            if knee is not choice:
                notes.append(f"{_memory(knee):.4g} GiB per GPU is within a point ({_pct(knee.hit_rate)})")
        rivals: dict[tuple, ConfigReport] = {}
        for r in clean:
            key = _line(r)
            if key != _line(choice) and choice.hit_rate - r.hit_rate <= KNEE_POINTS:
                rivals[key] = _best([rivals[key], r]) if key in rivals else r
        if rivals:
            notes.append("as good within a point: " + ", ".join(
                f"{_name(r, several, blocks)} {_pct(r.hit_rate)}" + (f" at {_memory(r):.4g} GiB" if sweep else "")
                for _, r in sorted(rivals.items())))
    elif objective.name == "per-gpu":
        def per_gib(r: ConfigReport) -> float:
            return r.cached_tokens / (_memory(r) * deployment.gpus(r.dcp))

        choice = max(clean, key=lambda r: (per_gib(r), -r.dcp))
        out["cached_tokens_per_gib"] = round(per_gib(choice), 1)
        notes.append(f"{per_gib(choice):,.0f} cached tokens per GiB of KV memory over {deployment.gpus(choice.dcp)} GPUs")
    else:
        reach = [r for r in clean if r.hit_rate >= objective.target]
        if not reach:
            best = _best(clean)
            return {**out, "choice": None,
                    "text": f"no configuration reaches {_pct(objective.target)}; the best is {_name(best, several, blocks)} at "
                    f"{_memory(best):.4g} GiB per GPU, {_pct(best.hit_rate)}"}
        choice = min(reach, key=lambda r: (_memory(r) * deployment.gpus(r.dcp), r.dcp))
        if _still_rising(choice, sweep):
            notes.append("the largest memory tried")
    gpus = deployment.gpus(choice.dcp)
    out["choice"] = {
        "dcp": choice.dcp, "eviction": choice.eviction, "kv_memory_gib": round(_memory(choice), 4),
        "kv_memory_bytes": choice.kv_memory_bytes, "hit_rate": round(choice.hit_rate, 6), "gpus": gpus,
    }
    if choice.block_size is not None:
        out["choice"]["block_size"] = choice.block_size
    out["head"] = (f"{objective.label()}: {_name(choice, several, blocks)} on {gpus} GPU{'s' * (gpus > 1)}, "
                   f"{_memory(choice):.4g} GiB KV per GPU, {_pct(choice.hit_rate)} hit rate")
    out["notes"] = notes
    out["text"] = out["head"] + "".join(f"; {n}" for n in notes)
    return out
