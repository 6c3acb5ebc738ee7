"""A whole plan: one workload through every configuration (DCP sizes, and with a memory sweep
KV memory sizes), then recommendations and diagnoses. Configurations run in worker processes
(one per core by default), each replaying lazily."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import time
from typing import Callable, Optional

from kvproof.planner import remedies
from kvproof.planner.diagnose import Diagnosis, auto_raised_blocks, diagnose
from kvproof.planner.memory import ModelMemory, PoolPlan, gib, plan_pool
from kvproof.planner.model_config import ModelLayout
from kvproof.planner.recommend import Deployment, Objective, recommend
from kvproof.planner.serve_command import serve_command, stock_config
from kvproof.planner.reuse import workload_reuse
from kvproof.planner.run import ConfigReport, RunOptions, check_capacity, run_config
from kvproof.sim.workload import Workload
from kvproof.spec.layout import Layout, LayoutConfig, resolve_layout


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan. Exactly one of ``kv_memory_bytes`` and ``num_blocks`` sizes the pool;
    ``memory`` (bytes per token / state, layers) is needed for the former."""

    workload: Workload
    base: LayoutConfig
    dcps: tuple[int, ...]
    memory: Optional[ModelMemory]
    kv_memory_bytes: Optional[int]
    num_blocks: Optional[int]
    sweep_bytes: tuple[int, ...] = ()
    options: RunOptions = RunOptions()
    jobs: int = 1
    reuse_probe: bool = True
    #: Engines per DCP size: kvproof's replay always; "vllm" adds vLLM 0.33.0's Scheduler with its
    #: own manager, "kvproof-vllm" the same Scheduler with kvproof's (what ``vllm serve`` runs).
    engines: tuple[str, ...] = ("kvproof",)
    #: kvproof's eviction policies, each planned at every DCP size and memory size.
    policies: tuple[str, ...] = ("lru",)
    #: Checkpoint policies (``spec.checkpoints``): the first is ``base``'s, the plan's own; each
    #: other is replayed beside it at every DCP size and eviction policy (kvproof's engine, and
    #: kvproof's manager in vLLM's Scheduler where that engine runs).
    checkpoints: tuple[str, ...] = ("vllm",)
    #: What ``--model`` read, when the layout came from a model folder.
    model: Optional[ModelLayout] = None
    objective: Objective = Objective("hit-rate")
    deployment: Deployment = Deployment(None)
    #: What the recommended ``vllm serve`` command serves (a folder; None: a placeholder).
    serve_model: Optional[str] = None
    #: The sweep is the automatic one: its points too small for the workload are left out.
    sweep_auto: bool = False
    #: The workload at another step time (ms -> Workload), for the recommended configuration's
    #: step-time sensitivity; None: not rebuildable (a pipe), so not checked.
    at_step_ms: Optional[Callable[[float], Workload]] = None
    step_ms: float = 50.0
    #: ``--block-size``: the attention block asked for in ``base`` (None: the layout's own), and
    #: each other one asked for with its layout, compared with ``base`` at every DCP size.
    block_size: Optional[int] = None
    other_blocks: tuple[tuple[int, LayoutConfig], ...] = ()

    @property
    def block_sizes(self) -> tuple[Optional[int], ...]:
        return (self.block_size,) + tuple(b for b, _ in self.other_blocks)

    def config_for(self, block_size: Optional[int]) -> LayoutConfig:
        """The layout planned for a requested block size (``base`` for the first)."""
        return self.base if block_size == self.block_size else dict(self.other_blocks)[block_size]


#: The engine name of kvproof's replay under stock vLLM 0.33.0's rules (``stock_config``).
STOCK = "stock"


@dataclasses.dataclass
class Task:
    dcp: int
    kv_memory_bytes: Optional[int]
    pool: PoolPlan
    sweep: bool
    engine: str = "kvproof"
    eviction: str = "lru"
    #: The layout to replay instead of the plan's (a remedy's).
    config: Optional[LayoutConfig] = None
    #: A checkpoint policy compared with the plan's (None: the plan's own).
    checkpoints: Optional[str] = None
    #: The requested block size of ``config`` (None: the plan's own, ``req.block_size``).
    block_size: Optional[int] = None

    def run(self, req: "PlanRequest", tick: Callable[[], None]) -> ConfigReport:
        report = self._run(req, tick)
        return dataclasses.replace(report, block_size=self.block_size if self.block_size is not None else req.block_size)

    def _run(self, req: "PlanRequest", tick: Callable[[], None]) -> ConfigReport:
        base = dataclasses.replace(self.config or req.base, eviction=self.eviction)
        if self.checkpoints is not None:
            base = dataclasses.replace(base, checkpoints=self.checkpoints)
        if self.engine == STOCK:
            report = run_config(req.workload, stock_config(base), self.dcp, self.pool, self.kv_memory_bytes,
                                req.options, tick)
            return dataclasses.replace(report, engine=STOCK)
        if self.engine != "kvproof":
            from kvproof.planner.vllm_engine import run_config_vllm

            if self.engine == "vllm":  # stock vLLM places vLLM's states only
                base = dataclasses.replace(base, checkpoints="vllm")
            return run_config_vllm(req.workload, base, self.dcp, self.pool, self.kv_memory_bytes, req.options, tick,
                                   self.engine)
        return run_config(req.workload, base, self.dcp, self.pool, self.kv_memory_bytes, req.options, tick)


@dataclasses.dataclass
class PlanResult:
    request: PlanRequest
    layouts: dict[int, Layout]
    reports: list[ConfigReport]  # kvproof's, one per DCP size
    sweep: list[ConfigReport]
    #: vLLM's Scheduler on the same configurations, with either manager (``engines``).
    vllm_reports: list[ConfigReport]
    recommendation: dict
    diagnoses: list[Diagnosis]
    reuse: dict[int, float]
    seconds: float
    #: Per layout group: how many vLLM groups (identical, each with its own blocks) it became.
    vllm_groups: tuple[int, ...] = ()
    #: Prompt tokens the reuse probe examined (fewer than the workload's on a long token trace).
    reuse_tokens: int = 0
    #: What the plan left out, one line each (the automatic sweep's too-small pools).
    notes: list[str] = dataclasses.field(default_factory=list)
    #: kvproof's engine under the other checkpoint policies (``PlanRequest.checkpoints[1:]``).
    checkpoint_reports: list[ConfigReport] = dataclasses.field(default_factory=list)
    #: Stock vLLM 0.33.0 with the same flags: kvproof's replay under vLLM's rules, one per DCP size.
    stock_reports: list[ConfigReport] = dataclasses.field(default_factory=list)

    @property
    def violations(self) -> int:
        return sum(len(r.violations) for r in self.reports + self.sweep)


def _pool_for(req: PlanRequest, layout: Layout, kv_bytes: Optional[int]) -> PoolPlan:
    if req.memory is None:
        if req.num_blocks is None:
            raise ValueError("no memory figures for this layout: give --bytes-per-token, --bytes-per-state and --layers, or --num-blocks")
        return PoolPlan((), 0, 1, tuple(1 for _ in layout.groups), 0, req.num_blocks)
    return plan_pool(layout, req.memory, kv_bytes, None if kv_bytes is not None else req.num_blocks)


def prepare(req: PlanRequest) -> tuple[dict[int, Layout], list[Task], list[str]]:
    """Resolve every layout and pool before any replay (bad input fails here, fast). The third
    item names the automatic sweep's points left out: pools too small for the longest request."""
    layouts = {d: resolve_layout(dataclasses.replace(req.base, dcp=d)) for d in req.dcps}
    longest = req.workload.longest_request
    tasks = []
    for d in req.dcps:
        pool = _pool_for(req, layouts[d], req.kv_memory_bytes)
        _check_pool(pool, d, req.kv_memory_bytes)
        check_capacity(longest, req.base, d, pool, req.options)  # the expanded geometry resolves too
        tasks += [Task(d, req.kv_memory_bytes, pool, False, eviction=e) for e in req.policies]
        if not _stock_is_planned(req):
            tasks.append(Task(d, req.kv_memory_bytes, pool, False, STOCK))
        tasks += [Task(d, req.kv_memory_bytes, pool, False, eviction=e, checkpoints=c)
                  for c in req.checkpoints[1:] for e in req.policies]
        if "vllm" in req.engines:
            tasks.append(Task(d, req.kv_memory_bytes, pool, False, "vllm"))
        if "kvproof-vllm" in req.engines:
            tasks += [Task(d, req.kv_memory_bytes, pool, False, "kvproof-vllm", e, checkpoints=c if i else None)
                      for i, c in enumerate(req.checkpoints) for e in req.policies]
    for b, config in req.other_blocks:  # each other block size at every DCP size, as the plan's own
        for d in req.dcps:
            try:
                pool = _pool_for(req, resolve_layout(dataclasses.replace(config, dcp=d)), req.kv_memory_bytes)
                _check_pool(pool, d, req.kv_memory_bytes)
                check_capacity(longest, config, d, pool, req.options)
            except ValueError as e:
                raise ValueError(f"--block-size {b}: {e}") from None
            tasks += [Task(d, req.kv_memory_bytes, pool, False, eviction=e, config=config, block_size=b)
                      for e in req.policies]
            if not _stock_is_planned(req):
                tasks.append(Task(d, req.kv_memory_bytes, pool, False, STOCK, config=config, block_size=b))
    left_out = []
    for kv in req.sweep_bytes:
        for d in req.dcps:
            pool = _pool_for(req, layouts[d], kv)
            try:
                _check_pool(pool, d, kv)
                check_capacity(longest, req.base, d, pool, req.options, remedy="give --memory-sweep sizes that hold it")
            except ValueError as e:
                if not req.sweep_auto:
                    raise ValueError(f"--memory-sweep {gib(kv):.4g} GiB per GPU: {e}") from None
                left_out.append(f"{gib(kv):.4g} GiB at DCP {d}")
                continue
            tasks += [Task(d, kv, pool, True, eviction=e) for e in req.policies]
    if left_out:
        left_out = [f"memory sweep: left out {', '.join(left_out)}: too small a pool for the longest request "
                    f"({longest:,} tokens)"]
    return layouts, tasks, left_out


def _stock_is_planned(req: PlanRequest) -> bool:
    """Whether the plan's own LRU run already is stock vLLM's (its rules are vLLM's): then that
    run is the stock column too, and is not replayed twice."""
    lru = dataclasses.replace(req.base, eviction="lru")
    return "lru" in req.policies and stock_config(lru) == lru


#: Most pool blocks a plan may ask for: the pool keeps two int lists per block, so this bounds
#: its memory to about 1 GiB.
MAX_POOL_BLOCKS = 16_000_000


def _check_pool(pool: PoolPlan, dcp: int, kv_bytes: Optional[int]) -> None:
    if pool.num_blocks < 2:
        what = f"{gib(kv_bytes):.4g} GiB per GPU" if kv_bytes is not None else f"{pool.num_blocks} blocks"
        per = f" ({pool.block_bytes / 2**20:.2f} MiB per block)" if pool.block_bytes else ""
        raise ValueError(f"DCP {dcp}: {what} make a pool of {pool.num_blocks} block(s){per}; expected at least 2 (block 0 is the null block)")
    if pool.num_blocks > MAX_POOL_BLOCKS:
        raise ValueError(
            f"DCP {dcp}: a pool of {pool.num_blocks:,} blocks is larger than kvproof simulates "
            f"({MAX_POOL_BLOCKS:,}); lower the KV memory or --num-blocks"
        )


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a plan is, in the workload's own requests: ``requests`` of ``workload`` is the share
    of the phase's replays done, as a count of the workload's requests (every configuration
    replays the whole workload, so 500 of 1,000 is half the phase's work however it is split
    over configurations and workers)."""

    phase: str
    requests: int
    workload: int
    configs_done: int
    configs: int

    def text(self) -> str:
        return (f"{self.phase}: requests {self.requests:,}/{self.workload:,}, "
                f"{self.configs_done}/{self.configs} configurations done")


ProgressCallback = Callable[[Progress], None]

#: The phases, in order: the planned configurations, the diagnoses' remedies, the recommended
#: configuration at other step times.
PHASES = ("replaying", "testing remedies", "step-time check")


class _Counter:
    """Finished requests per configuration of one phase, reported as a :class:`Progress`."""

    def __init__(self, phase: str, workload: int, configs: int, progress: Optional[ProgressCallback],
                 counts=None) -> None:
        self.phase, self.workload, self.progress = phase, workload, progress
        self.counts = counts if counts is not None else [0] * configs
        self.done = 0

    def tick(self, index: int) -> None:
        self.counts[index] += 1
        self.report()

    def report(self) -> None:
        if self.progress is not None:
            configs = len(self.counts)
            requests = min(self.workload, sum(self.counts) // configs) if configs else self.workload
            if self.done == configs:  # a replay stopped by a violation finishes short of the workload
                requests = self.workload
            self.progress(Progress(self.phase, requests, self.workload, self.done, configs))


# Worker processes inherit the request through fork (the workload's builders are closures).
_SHARED: dict = {}


def _run_task(index: int) -> tuple[int, ConfigReport]:
    req: PlanRequest = _SHARED["request"]
    task: Task = _SHARED["tasks"][index]
    done = _SHARED["progress"]

    def tick() -> None:
        done[index] += 1

    return index, task.run(req, tick)


def run_plan(req: PlanRequest, progress: Optional[ProgressCallback] = None) -> PlanResult:
    """Run every configuration; ``progress`` (a :class:`Progress`) is called as requests finish.
    Raises ValueError / CapacityError for input a configuration cannot serve."""
    started = time.perf_counter()
    layouts, tasks, notes = prepare(req)
    results = _run_tasks(req, tasks, progress, PHASES[0])
    reports = [r for r, t in zip(results, tasks) if not t.sweep and t.engine == "kvproof" and t.checkpoints is None]
    stock = [r for r, t in zip(results, tasks) if t.engine == STOCK]
    if _stock_is_planned(req):
        stock = [dataclasses.replace(r, engine=STOCK) for r in reports if r.eviction == "lru"]
    compared = [r for r, t in zip(results, tasks) if t.checkpoints is not None and t.engine == "kvproof"]
    vllm_reports = [r for r, t in zip(results, tasks) if t.engine not in ("kvproof", STOCK)]
    sweep = [r for r, t in zip(results, tasks) if t.sweep]
    if sweep:  # the main runs are sweep points too
        sweep = sorted(sweep + [r for r in reports if r.kv_memory_bytes is not None],
                       key=lambda r: (r.dcp, r.kv_memory_bytes or 0, req.policies.index(r.eviction)))
    reuse, reuse_tokens = {}, 0
    if req.reuse_probe:
        units = {layouts[d].cache_hit_alignment for d in req.dcps} | {_fine_unit(layouts)}
        units |= {resolve_layout(dataclasses.replace(config, dcp=d)).cache_hit_alignment  # every block size's unit
                  for _, config in req.other_blocks for d in req.dcps}
        units = sorted(units)
        probe = workload_reuse(req.workload, tuple(units))
        reuse, reuse_tokens = probe.fractions, probe.examined_tokens
    prompt_lengths = [e.prompt_len for e in req.workload.entries]
    own = [r for r in reports if r.block_size == req.block_size]  # the diagnoses' remedies replay the plan's own layout
    diagnoses = diagnose(layouts, own, prompt_lengths, req.options.max_num_seqs, req.memory, reuse)
    if req.other_blocks:  # the diagnoses above are about the plan's own block size: name it
        diagnoses = [dataclasses.replace(d, message=f"--block-size {req.block_size}: {d.message}") for d in diagnoses]
    if req.memory is not None:
        for b, config in req.other_blocks:
            diagnoses += [dataclasses.replace(d, message=f"--block-size {b}: {d.message}")
                          for d in auto_raised_blocks(resolve_layout(config), req.memory, prompt_lengths)]
    diagnoses = _replay_remedies(req, diagnoses, results, tasks, _fine_unit(layouts), progress)
    return PlanResult(
        req, layouts, reports, sweep, vllm_reports, _recommendation(req, reports, sweep, vllm_reports, stock, progress), diagnoses,
        reuse, time.perf_counter() - started, tasks[0].pool.vllm_groups, reuse_tokens, notes, compared, stock,
    )


def _run_tasks(req: PlanRequest, tasks: list[Task], progress: Optional[ProgressCallback], phase: str) -> list[ConfigReport]:
    """Every task's report, in order, in worker processes when ``req.jobs`` allows."""
    jobs = max(1, min(req.jobs, len(tasks)))
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        return _run_parallel(req, tasks, jobs, progress, phase)
    counter = _Counter(phase, len(req.workload), len(tasks), progress)
    results = []
    for i, t in enumerate(tasks):
        results.append(t.run(req, lambda i=i: counter.tick(i)))
        counter.done += 1
        counter.report()
    return results


def _replay_remedies(req: PlanRequest, diagnoses: list[Diagnosis], results: list[ConfigReport], tasks: list[Task],
                     fine_unit: int, progress) -> list[Diagnosis]:
    """Each diagnosis with remedies, replayed with every candidate at its DCP size in the same pool
    (kvproof's engine, the first eviction policy), its message ending with what they measured."""
    measured = {r.dcp: (r, t) for r, t in zip(results, tasks) if t.engine == "kvproof" and not t.sweep
                and t.eviction == req.policies[0] and t.checkpoints is None and t.config is None}
    plans = [(d, remedy) for d in diagnoses if d.dcp in measured
             for remedy in remedies.candidates(d, req.base, fine_unit)]
    if not plans:
        return diagnoses
    trial_tasks = [dataclasses.replace(measured[d.dcp][1], config=remedy.apply(req.base)) for d, remedy in plans]
    after = _run_tasks(req, trial_tasks, progress, PHASES[1])
    out = []
    for d in diagnoses:
        trials = [remedies.Trial(d, remedy, measured[d.dcp][0], a) for (dd, remedy), a in zip(plans, after) if dd is d]
        clause = remedies.summary(trials)
        out.append(d if clause is None else dataclasses.replace(
            d, message=f"{d.message}; {clause}", remedies=tuple(remedies.to_json(trials))))
    return out


def _recommendation(req: PlanRequest, reports: list[ConfigReport], sweep: list[ConfigReport],
                    served: list[ConfigReport], stock: list[ConfigReport],
                    progress: Optional[ProgressCallback] = None) -> dict:
    """The recommendation, with the ``vllm serve`` command of its choice, stock vLLM's hit rate
    with the same flags at its DCP size (when it is at the plan's own memory size) and, when the
    plan ran vLLM's Scheduler, what that command measured there beside stock vLLM."""
    out = recommend(reports, sweep, req.objective, req.deployment)
    choice = out["choice"]
    if choice is not None:
        block = choice.get("block_size")
        if req.at_step_ms is not None:
            _step_sensitivity(req, out, next(r for r in reports + sweep if r.dcp == choice["dcp"] and r.block_size == block
                                             and r.kv_memory_bytes == choice["kv_memory_bytes"] and r.eviction == choice["eviction"]),
                              progress)
        command = serve_command_for(req, choice["dcp"], choice["eviction"], choice["kv_memory_bytes"], block_size=block)
        out["serve"] = command.text()
        out["not_reproduced"] = list(command.not_reproduced)
        same_stock = next((r for r in stock if r.dcp == choice["dcp"] and r.kv_memory_bytes == choice["kv_memory_bytes"]
                           and r.block_size == block), None)
        if same_stock is not None:
            out["stock_hit_rate"] = round(same_stock.hit_rate, 6)
            out["stock_serve"] = serve_command_for(req, choice["dcp"], "lru", choice["kv_memory_bytes"], "vllm",
                                                   block_size=block).text()
        same = [r for r in served if r.dcp == choice["dcp"] and r.kv_memory_bytes == choice["kv_memory_bytes"]
                and r.eviction in (choice["eviction"], "lru") and r.checkpoints == req.base.checkpoints
                and r.block_size == block]
        engine = "kvproof-vllm" if command.env else "vllm"
        ours = next((r for r in same if r.engine == engine and r.eviction == choice["eviction"]), None)
        stock = next((r for r in same if r.engine == "vllm"), None)
        if ours is not None and stock is not None:
            out["served_hit_rate"] = {"this command": round(ours.hit_rate, 6), "stock vllm": round(stock.hit_rate, 6)}
    return out


#: Step times the sensitivity check replays, as factors of the plan's.
STEP_FACTORS = (0.5, 2.0)


def _step_sensitivity(req: PlanRequest, out: dict, chosen: ConfigReport, progress: Optional[ProgressCallback]) -> None:
    """Mutates ``out``. The recommended configuration replayed at half and double the step time
    (``step_ms_sensitivity``); a note when either moves its hit rate by more than a point."""
    config = req.config_for(chosen.block_size)
    pool = _pool_for(req, resolve_layout(dataclasses.replace(config, dcp=chosen.dcp)), chosen.kv_memory_bytes)
    base = dataclasses.replace(config, eviction=chosen.eviction)
    rates = {}
    counter = _Counter(PHASES[2], len(req.workload), len(STEP_FACTORS), progress)
    for i, f in enumerate(STEP_FACTORS):
        ms = req.step_ms * f
        rates[ms] = run_config(req.at_step_ms(ms), base, chosen.dcp, pool, chosen.kv_memory_bytes, req.options,
                               lambda i=i: counter.tick(i)).hit_rate
        counter.done += 1
        counter.report()
    out["step_ms_sensitivity"] = {f"{ms:g}": round(r, 6) for ms, r in rates.items()}
    if any(abs(r - chosen.hit_rate) > 0.01 for r in rates.values()):
        out.setdefault("notes", []).append(
            "step time matters: --step-ms " + ", ".join(f"{ms:g} gives {100 * r:.1f} %" for ms, r in rates.items())
            + f" (here {req.step_ms:g}: {100 * chosen.hit_rate:.1f} %); give your server's step time")


def serve_command_for(req: PlanRequest, dcp: int, eviction: str, kv_memory_bytes: Optional[int], manager: str = "auto",
                      checkpoints: Optional[str] = None, block_size: Optional[int] = None):
    """The ``vllm serve`` command (``serve_command.ServeCommand``) of one planned configuration
    (``manager`` as ``serve_command`` takes it; ``checkpoints`` None: the plan's policy;
    ``block_size`` the requested block, None: the plan's own)."""
    block_size = block_size if block_size is not None else req.block_size
    base = req.config_for(block_size)
    config = dataclasses.replace(base, eviction=eviction, checkpoints=checkpoints or base.checkpoints)
    return serve_command(
        stock_config(config) if manager == "vllm" else config, dcp, req.deployment.gpus(dcp), kv_memory_bytes,
        req.options.max_num_batched_tokens, req.options.max_num_seqs, model=req.serve_model,
        block_size_from_model=req.model is not None, eagle=req.options.use_eagle, manager=manager,
        requested_block_size=block_size if req.model is not None else None,
    )


def _fine_unit(layouts: dict[int, Layout]) -> int:
    """The fine reference for the hash-unit probe: 16 tokens (vLLM's default attention block),
    or the smallest hit unit when that is finer."""
    return min([16] + [lay.cache_hit_alignment for lay in layouts.values()])


def _worker_init() -> None:
    """In each worker: default signal handling (the parent reports Ctrl-C / SIGTERM and then
    terminates the pool; a worker just dies), and on Linux death with the parent, so a killed
    plan leaves no worker behind."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _run_parallel(req: PlanRequest, tasks: list[Task], jobs: int, progress: Optional[ProgressCallback],
                  phase: str) -> list[ConfigReport]:
    ctx = multiprocessing.get_context("fork")
    counters = ctx.Array("q", len(tasks), lock=False)
    counter = _Counter(phase, len(req.workload), len(tasks), progress, counters)
    _SHARED.update(request=req, tasks=tasks, progress=counters)
    results: list = [None] * len(tasks)
    try:
        with ctx.Pool(jobs, initializer=_worker_init) as pool:
            finished = pool.imap_unordered(_run_task, range(len(tasks)), chunksize=1)
            while counter.done < len(tasks):
                try:
                    index, report = finished.next(timeout=0.25)
                except multiprocessing.TimeoutError:
                    pass
                else:
                    results[index] = report
                    counter.done += 1
                counter.report()
            pool.close()  # let the workers exit on their own before the pool is torn down
            pool.join()
    finally:
        _SHARED.clear()
    return results


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def progress_bar(enabled: bool, file=None):
    """A ``progress`` callback drawing a tqdm bar on ``file`` (stderr), one per phase, and its
    closer; both no-ops when disabled (not a terminal, or --no-progress). The bar counts the
    workload's requests ("replaying: requests 412/1,000, 3/9 configurations done")."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = None
    phase = None
    drawn = 0.0

    def update(p: Progress) -> None:
        nonlocal bar, phase, drawn
        if bar is None or p.phase != phase:
            close()
            phase = p.phase
            bar = tqdm(total=p.workload, leave=False, file=file or sys.stderr, dynamic_ncols=True,
                       bar_format="{desc} |{bar}| {elapsed}<{remaining}")
        now = time.monotonic()
        if now - drawn >= 0.1 or p.configs_done == p.configs:  # called per request: draw at most 10 times a second
            drawn = now
            bar.n = p.requests
            bar.set_description_str(p.text(), refresh=False)
            bar.refresh()

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close
