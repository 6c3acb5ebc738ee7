"""vLLM 0.33.0's whole engine, in process, on CPU: its engine core, scheduler and KV-cache
manager unchanged, kvproof's model-free executor for the workers (cpu_executor.py) and kvproof's
checked scheduler (``--scheduler-cls``). The teeth of the checks, through the real engine."""

from __future__ import annotations

import random
import re

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator  # noqa: E402
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: E402
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MambaSpec  # noqa: E402

from kvproof.integrations.vllm import cpu_executor  # noqa: E402
from kvproof.integrations.vllm.cpu_executor import model_kv_cache_specs, staged_gpu_memory  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness  # noqa: E402
from kvproof.integrations.vllm.kv_specs import layout_from_vllm  # noqa: E402
from kvproof.integrations.vllm.tiny_model import tiny_model_dir  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.contracts import InvariantViolation  # noqa: E402

EXECUTOR = "kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor"
CHECKED = "kvproof.integrations.vllm.checked_scheduler.CheckedScheduler"


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("KVPROOF_CONTRACTS", "cheap")
    monkeypatch.delenv("KVPROOF_ON_VIOLATION", raising=False)


def make_engine(dcp=1, block_size=16, num_blocks=512, max_model_len=2048, checked=True, **extra) -> LLMEngine:
    args = EngineArgs(
        model=tiny_model_dir(), skip_tokenizer_init=True, block_size=block_size, num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=True, max_model_len=max_model_len, tensor_parallel_size=dcp,
        decode_context_parallel_size=dcp, distributed_executor_backend=EXECUTOR,
        scheduler_cls=CHECKED if checked else None, max_num_seqs=16, max_num_batched_tokens=256, **extra,
    )
    return LLMEngine.from_engine_args(args)


def core_of(engine):
    return engine.engine_core.engine_core


def drive(engine, requests):
    """Run ``requests`` = [(id, prompt, max_tokens, arrival)]: each is added before the engine
    step whose index equals its arrival. Returns {id: (num_cached_tokens, output tokens)}."""
    pending, done, step = sorted(requests, key=lambda r: r[3]), {}, 0
    while pending or engine.has_unfinished_requests():
        step += 1
        while pending and pending[0][3] <= step:
            rid, prompt, max_tokens, _ = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": list(prompt)}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.num_cached_tokens, tuple(out.outputs[0].token_ids))
    return done


def test_the_executor_reports_the_models_real_kv_specs():
    engine = make_engine(dcp=2)
    try:
        specs = model_kv_cache_specs(core_of(engine).vllm_config)
        attention, mamba = specs["model.layers.1"], specs["model.layers.0"]
        assert isinstance(attention, FullAttentionSpec) and isinstance(mamba, MambaSpec)
        assert (attention.block_size, attention.num_kv_heads, attention.head_size) == (16, 1, 256)
        # The gated delta net's state per rank at TP 2 (tiny_model.py): a conv state of kernel - 1 = 3
        # rows by (2 key heads + 1 value head) x 8 heads x 16 / 2 ranks = 192 channels, and an SSM
        # state of 8 / 2 value heads x 16 x 16.
        assert mamba.shapes == ((3, 192), (4, 16, 16)) and mamba.block_size == 16
        assert mamba.mamba_cache_mode == "align"
    finally:
        engine.engine_core.shutdown()


def test_chats_through_the_engine_pass_every_check_and_hit_as_the_harness():
    """Multi-turn chats, one request at a time, TP 2 / DCP 2: the checked scheduler and the
    executor's content oracle find nothing, and every request's cached tokens equal what vLLM's
    Scheduler alone (the engine harness) gives on the same trace."""
    engine = make_engine(dcp=2, num_blocks=256)
    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(150)]
    trace, served = [], {}
    try:
        for c in range(3):
            history = list(system)
            for t in range(3):
                history += [rng.randrange(1000) for _ in range(rng.randrange(5, 60))]
                rid, max_tokens = f"c{c}t{t}", rng.randrange(1, 6)
                served[rid], output = drive(engine, [(rid, history, max_tokens, 1)])[rid]
                trace.append(TraceRequest(rid, tuple(history), output, 1 + 200 * len(trace)))
                history += output
        core = core_of(engine)
        assert core.model_executor.sink.messages == []
        layout = layout_from_vllm(core.scheduler.kv_cache_config, core.vllm_config)
    finally:
        engine.engine_core.shutdown()
    ours = EngineHarness(layout, 256, max_num_batched_tokens=256, max_num_seqs=16).run(trace)
    assert served == ours.num_cached_tokens
    assert sum(served.values()) > 0


def _pre_fix_width(self, vllm_config, max_model_len):
    return cdiv(max_model_len, self.block_size * vllm_config.parallel_config.decode_context_parallel_size)


def test_pre_fix_width_rule_stops_the_engine_at_start(monkeypatch):
    """1M context, DCP 8 (TP 8, eight in-process ranks), 16-token Mamba: with vLLM's width rule
    patched back to dividing every group by DCP, the engine refuses to start."""
    monkeypatch.setattr(MambaSpec, "max_num_blocks_per_req", _pre_fix_width)
    monkeypatch.setattr(AttentionSpec, "max_num_blocks_per_req", _pre_fix_width)
    with pytest.raises(InvariantViolation, match=r"INV-TABLE-WIDTH: group 0 \(mamba:16\): vLLM sizes the block-table "
                                                 r"row at 8,192 entries; kvproof's geometry needs 65,536 for "
                                                 r"max_model_len 1,048,576 at DCP 8"):
        make_engine(dcp=8, max_model_len=1 << 20, num_blocks=9000)


def _release_the_attention_row_twice(monkeypatch):
    free = HybridKVCacheCoordinator.free

    def buggy(self, request_id):
        held = list(self.single_type_managers[1].req_to_blocks.get(request_id, ()))
        free(self, request_id)
        self.block_pool.free_blocks(reversed(held))
    monkeypatch.setattr(HybridKVCacheCoordinator, "free", buggy)


@pytest.mark.parametrize("action", ["raise", "log"])
def test_a_double_free_stops_the_engine_before_the_pool_changes(monkeypatch, action):
    """In log mode too: a double free is always fatal (violations.ALWAYS_FATAL), serving on would
    hand the block to two requests."""
    monkeypatch.setenv("KVPROOF_ON_VIOLATION", action)
    _release_the_attention_row_twice(monkeypatch)
    engine = make_engine()
    try:
        with pytest.raises(InvariantViolation, match=r"INV-POOL-REF-NONNEG: step \d+, request 'a-\w+': block \d+ is freed "
                                                     r"with reference count 0; it would drop to -1"):
            drive(engine, [("a", range(100), 2, 1)])
        pool = core_of(engine).scheduler.kv_cache_manager.block_pool
        assert min(b.ref_cnt for b in pool.blocks if not b.is_null) == 0  # refused before the free ran
    finally:
        engine.engine_core.shutdown()


def test_without_checks_vllm_runs_on_after_the_double_free(monkeypatch):
    """Control: vLLM itself does not notice; the pool is left with negative reference counts."""
    _release_the_attention_row_twice(monkeypatch)
    engine = make_engine(checked=False)
    try:
        assert drive(engine, [("a", range(100), 2, 1)])["a"][0] == 0
        pool = core_of(engine).scheduler.kv_cache_manager.block_pool
        assert min(b.ref_cnt for b in pool.blocks if not b.is_null) == -1
    finally:
        engine.engine_core.shutdown()


#: The Hypothesis-found hazard of test_checked_scheduler.py, through the whole engine (FA 4 +
#: Mamba 4, H 2; vLLM orders the Mamba group first here, so attention is group 1).
COW_REQUESTS = [("r0", (0,) * 11, 1, 1), ("r2", (0,) * 17, 1, 1), ("r1", (0,) * 13, 1, 2)]


def test_vllms_copy_of_an_unwritten_block_stops_the_engine_naming_request_and_step():
    engine = make_engine(block_size=4, prefix_match_unit=2, max_model_len=256)
    try:
        with pytest.raises(InvariantViolation, match=r"INV-COW-SOURCE-READY: step 4, request 'r1-\w+', group 1 "
                                                     r"\(full_attention:4\): copy \d+ -> \d+ chains"):
            drive(engine, COW_REQUESTS)
    finally:
        engine.engine_core.shutdown()


def test_in_log_mode_the_worker_side_sees_the_same_hazard(monkeypatch):
    """Logged and counted instead of raised: the scheduler-side check, the worker's copy-batch
    check and the executor's content oracle all report step 4; the engine keeps serving."""
    monkeypatch.setenv("KVPROOF_ON_VIOLATION", "log")
    engine = make_engine(block_size=4, prefix_match_unit=2, max_model_len=256)
    try:
        served = drive(engine, COW_REQUESTS)
        core = core_of(engine)
        scheduler_side = core.scheduler.kv_cache_manager._kvproof_checker.sink
        worker_side = core.model_executor.sink
    finally:
        engine.engine_core.shutdown()
    assert {rid: hit for rid, (hit, _) in served.items()} == {"r0": 0, "r1": 10, "r2": 10}
    assert scheduler_side.counts["INV-COW-SOURCE-READY"] == 2
    assert worker_side.counts["INV-COW-SOURCE-READY"] == 1
    assert any(m.startswith("INV-CONTENT-KV: step 4, request 'r1-") for m in worker_side.messages)


def test_unchecked_vllm_serves_the_hazard_without_a_word(monkeypatch):
    """Control: with vLLM's own scheduler, nothing in vLLM notices; only the executor's content
    oracle (logged here) sees r1 read attention KV its copy never delivered."""
    monkeypatch.setenv("KVPROOF_ON_VIOLATION", "log")
    engine = make_engine(block_size=4, prefix_match_unit=2, max_model_len=256, checked=False)
    try:
        served = drive(engine, COW_REQUESTS)
        core = core_of(engine)
        assert not hasattr(core.scheduler.kv_cache_manager, "_kvproof_checker")
        oracle = core.model_executor.sink
    finally:
        engine.engine_core.shutdown()
    assert {rid: hit for rid, (hit, _) in served.items()} == {"r0": 0, "r1": 10, "r2": 10}
    assert any(m.startswith("INV-CONTENT-KV: step 4, request 'r1-") for m in oracle.messages)


# --- the staged GPU memory -----------------------------------------------------------------------


@pytest.mark.parametrize("text, size", [("", 80 << 30), ("80GiB", 80 << 30), ("141GB", 141 * 10**9), ("1.5 GiB", 3 << 29),
                                        ("96000000000", 96 * 10**9), ("512mib", 512 << 20)])
def test_staged_gpu_memory_reads_sizes(text, size):
    assert staged_gpu_memory(text)[0] == size


@pytest.mark.parametrize("text", ["lots", "80 GiBs", "-1GiB", "0", "1e3GB", "2PiB", "80GiB extra"])
def test_a_staged_gpu_memory_that_is_no_size_is_refused_naming_it(text):
    with pytest.raises(ValueError, match=f"KVPROOF_STAGING_GPU_MEMORY={text!r}; expected a GPU's memory such as 80GiB"):
        staged_gpu_memory(text)


def test_without_an_override_a_pool_this_machine_cannot_hold_is_refused_at_start(monkeypatch):
    """The default staged GPU (80 GiB) gives the tiny model millions of blocks; with 1 GB of host
    memory left, the start is refused in one line that says what to pass, before vLLM builds the pool."""
    monkeypatch.setattr(cpu_executor, "available_memory", lambda: 10**9)
    with pytest.raises(ValueError) as refused:
        make_engine(num_blocks=None)
    message = str(refused.value)
    assert "\n" not in message
    assert re.fullmatch(r"the CPU staging executor would stage [\d,]+ blocks per rank, about [\d.,]+ GB of host memory "
                        r"for vLLM's block pool and kvproof's checks \(1024 bytes per block\), but this machine has 1\.0 "
                        r"GB available; pass --num-gpu-blocks-override 976,562 or less, or a smaller "
                        r"KVPROOF_STAGING_GPU_MEMORY \(or --kv-cache-memory-bytes\)", message), message


def _num_blocks(**extra) -> int:
    engine = make_engine(num_blocks=None, **extra)
    try:
        return core_of(engine).scheduler.kv_cache_config.num_blocks
    finally:
        engine.engine_core.shutdown()


def test_a_stated_gpu_memory_sizes_the_pool_as_vllm_sizes_that_much_kv_memory(monkeypatch):
    """64 MiB staged, gpu_memory_utilization 0.92 (vLLM's default): the pool vLLM builds from
    exactly that much KV memory (--kv-cache-memory-bytes, which the executor passes through)."""
    monkeypatch.setenv("KVPROOF_STAGING_GPU_MEMORY", "64MiB")
    staged = _num_blocks()
    monkeypatch.setenv("KVPROOF_STAGING_GPU_MEMORY", "1TiB")  # ignored when vLLM is told the KV memory
    assert staged == _num_blocks(kv_cache_memory_bytes=int((64 << 20) * 0.92)) > 100


# --- speculative decoding: the stand-in drafter and the drafts' KV in the content model ---------


def test_the_stand_in_drafter_gets_drafts_wrong_by_its_rule_and_verification_rejects_from_there():
    vocab, eos = 1024, 1023
    for length in range(1, 9):
        tokens = [random.Random(length).randrange(1000) for _ in range(length)]
        drafts = cpu_executor.draft_tokens(tokens, 3, vocab, eos)
        sampled = cpu_executor.verify_drafts(tokens, drafts, vocab, eos)
        # The first wrong draft is the one proposed where the drafted sequence's length is 3 mod 4.
        right = next((i for i in range(3) if (length + i) % 4 == 3), 3)
        assert sampled[:-1] == drafts[:right] and len(sampled) == right + 1
        truth = list(tokens)
        for _ in range(right + 1):
            truth.append(cpu_executor.next_token(truth, vocab, eos))
        assert sampled == truth[length:]  # what is sampled never depends on the drafts
        assert eos not in drafts


def _step(new=(), cached=(), spec=None):
    """A SchedulerOutput as the worker model reads it: ``new`` = [(id, prompt, computed, n,
    blocks)], ``cached`` = [(id, computed, n, new blocks)]."""
    from types import SimpleNamespace

    return SimpleNamespace(
        finished_req_ids=set(), kv_cache_block_copies=(), scheduled_spec_decode_tokens=spec or {},
        num_scheduled_tokens={**{r[0]: r[3] for r in new}, **{r[0]: r[2] for r in cached}},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p, num_computed_tokens=c, block_ids=b)
                            for r, p, c, _, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r[0] for r in cached], resumed_req_ids=set(),
                                              num_computed_tokens=[r[1] for r in cached],
                                              new_block_ids=[r[3] for r in cached]),
    )


@pytest.mark.parametrize("reused", [4, 5, 6])
def test_a_rejected_drafts_kv_is_another_prefixs_for_every_later_reader(reused):
    """r0 decodes at position 3 with drafts (5, 99); 5 is accepted, 99 rejected (the true token
    is 6), so block 2 holds at position 5 the KV of a draft nobody keeps. r1 (r0's tokens and
    one more) reuses r0's blocks up to ``reused`` tokens: up to the accepted draft it reads the
    right KV; past it, the rejected draft's, which the content model reports."""
    from kvproof.integrations.vllm.worker_model import WorkerModel
    from kvproof.spec.groups import CacheGroup, GroupKind
    from kvproof.spec.layout import LayoutConfig, resolve_layout

    model = WorkerModel(resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),), max_model_len=64)))
    model.run_step(_step(new=[("r0", [1, 2, 3], 0, 3, ([1],))]))
    model.sampled("r0", [4])
    model.run_step(_step(cached=[("r0", 3, 3, ([2],))], spec={"r0": [5, 99]}))
    model.sampled("r0", [5, 6])  # one draft accepted, then the true token
    assert model.violations == []
    blocks = [1, 2] if reused > 4 else [1]
    model.run_step(_step(new=[("r1", [1, 2, 3, 4, 5, 6, 7], reused, 7 - reused, (blocks + [3],))]))
    if reused <= 5:
        assert model.violations == []
    else:
        assert len(model.violations) == 1 and model.violations[0].startswith(
            "INV-CONTENT-KV: request 'r1', group 0, rank 0: position 5 reads block 2"), model.violations


def test_after_a_rejection_the_next_chunk_starts_from_the_state_after_the_accepted_tokens():
    """A Mamba group: the step with drafts ends its chunk after the rejected draft, but the next
    chunk must start from the state after the accepted tokens (the kernel keeps one per draft
    position); a chunk starting anywhere else reads a state that is not its own."""
    from kvproof.integrations.vllm.worker_model import WorkerModel
    from kvproof.spec.groups import CacheGroup, GroupKind
    from kvproof.spec.layout import LayoutConfig, resolve_layout

    layout = resolve_layout(LayoutConfig((CacheGroup(GroupKind.MAMBA, 4), CacheGroup(GroupKind.FULL_ATTENTION, 4)),
                                         max_model_len=64))
    runs = {}
    for start in (5, 6):
        model = WorkerModel(layout)
        model.run_step(_step(new=[("r0", [1, 2, 3], 0, 3, ([1], [2]))]))
        model.sampled("r0", [4])
        model.run_step(_step(cached=[("r0", 3, 3, ([3], [4]))], spec={"r0": [5, 99]}))
        model.sampled("r0", [5, 6])
        model.run_step(_step(cached=[("r0", start, 1, ([], []))]))
        runs[start] = model.violations
    assert runs[5] == []  # vLLM's rollback: 3 computed + 1 accepted draft + the decode token
    assert len(runs[6]) == 1 and runs[6][0].startswith("INV-CONTENT-STATE: request 'r0', group 0"), runs[6]
