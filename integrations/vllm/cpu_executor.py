"""A model-free vLLM executor for CPU staging: rehearse a deployment's KV-cache behaviour with
its real ``config.json``, real geometry and real traffic, without weights or a GPU.

    VLLM_TARGET_DEVICE=cpu vllm serve ./model-dir --skip-tokenizer-init --block-size 16 \\
        --num-gpu-blocks-override 4096 --tensor-parallel-size 2 --decode-context-parallel-size 2 \\
        --distributed-executor-backend kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor

vLLM's engine core, scheduler, KV-cache manager, API server and metrics run unchanged; only the
workers are stood in for, all TP ranks in the engine-core process. Each rank:

* reports the model's real KV-cache specs, computed from the model class as vLLM's model runner
  would (attention layers: per-rank KV heads, head size, cache dtype; linear-attention layers:
  the class's ``get_mamba_state_shape_from_config`` / ``..._dtype_from_config``);
* keeps its block tables in vLLM's own V1 ``MultiGroupBlockTable`` (sized with vLLM's width rule,
  written with its ``add_row`` / ``append_row``, so kvproof's worker-side checks see them);
* and the executor applies every step -- copies, then the forward pass's writes and reads, on
  every DCP rank -- to a content-tracking model of the KV cache (``worker_model.WorkerModel``,
  kvproof's content oracle). A read of anything but this request's own prefix is reported as
  ``INV-CONTENT-KV`` / ``INV-CONTENT-STATE`` (raised, or logged and counted, per
  ``KVPROOF_ON_VIOLATION``).

Sampling is deterministic: the next token is a fixed function of the sequence so far
(:func:`next_token`), never the model's EOS id. With speculative decoding configured
(``--speculative-config``, e.g. ``{"method": "mtp", "num_speculative_tokens": 2}``: no draft
model is loaded) the executor stands in for the drafter too: after each step it proposes, for
every request that sampled, drafts derived from its tokens by a fixed rule that gets some wrong
(:func:`draft_tokens`); a step verifies them against :func:`next_token` as a rejection sampler
would -- the drafts up to the first wrong one are accepted, then one token is sampled -- so vLLM
rolls back the rejected ones, deterministically.

Async scheduling (GPU runs' default) is staged when asked for with ``--async-scheduling``
(vLLM's CPU platform turns it off; with this executor an explicit request is kept, see
``_keep_async_scheduling``): the engine schedules step N+1 before it processes step N's output.
The executor runs each step when it is handed over, in order, so the content model sees what a
GPU stream does (step N's writes before step N+1's copies and reads), and returns the sampled
tokens from ``sample_tokens`` as vLLM's model runner does.
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import Future
from typing import Callable, Optional

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import get_model_architecture
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode
from vllm.v1.worker.worker_base import CompilationTimes

from kvproof.cli.limits import available_memory
from kvproof.integrations.vllm import stop_report
from kvproof.integrations.vllm.kv_specs import layout_from_vllm
from kvproof.integrations.vllm.violations import ViolationSink, logger
from kvproof.integrations.vllm.worker_checks import check_copy_batch
from kvproof.integrations.vllm.worker_model import WorkerModel

#: The GPU memory one rank stages unless KVPROOF_STAGING_GPU_MEMORY says otherwise: an 80 GB
#: H100's (80 GiB; vLLM gives the KV cache ``gpu_memory_utilization`` of it).
DEFAULT_GPU = ("an 80 GB H100", 80 << 30)
GPU_MEMORY_ENV = "KVPROOF_STAGING_GPU_MEMORY"
#: What the workers report with --num-gpu-blocks-override (the override sizes the pool; this only
#: has to pass vLLM's check that one request of max_model_len fits).
_AVAILABLE_WITH_OVERRIDE = 1 << 40
#: Host memory one staged block may take: vLLM's KVCacheBlock and its free-queue links (136
#: bytes, measured: docs/vllm.md) and kvproof's records of the checks and of the content model,
#: which grow as blocks are written (per block and rank). A budget, rounded up.
HOST_BYTES_PER_BLOCK = 1024
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")


def staged_gpu_memory(value: Optional[str] = None) -> tuple[int, str]:
    """(bytes, what they are) of one rank's staged GPU memory: ``value`` (default
    ``KVPROOF_STAGING_GPU_MEMORY``) as a size -- ``80GiB``, ``141GB``, ``96000000000`` (bytes)
    -- or :data:`DEFAULT_GPU` when unset. ValueError naming the value otherwise."""
    raw = os.environ.get(GPU_MEMORY_ENV, "") if value is None else value
    if not raw.strip():
        return DEFAULT_GPU[1], f"{DEFAULT_GPU[1] / 2**30:g} GiB ({DEFAULT_GPU[0]}'s; {GPU_MEMORY_ENV} sets another)"
    match = _SIZE.fullmatch(raw.strip())
    unit = match[2].lower() if match else None
    if unit not in _UNITS or not 0 < float(match[1]) * _UNITS[unit] < 1 << 50:
        raise ValueError(f"{GPU_MEMORY_ENV}={raw!r}; expected a GPU's memory such as 80GiB, 141GB or a number of bytes "
                         "(at most 1 PiB)")
    size = int(float(match[1]) * _UNITS[unit])
    return size, f"{size / 2**30:.4g} GiB ({GPU_MEMORY_ENV})"


def next_token(token_ids: list[int], vocab_size: int, eos_token_id: Optional[int]) -> int:
    """The token the stand-in model samples after ``token_ids`` (pure)."""
    token = (31 * token_ids[-1] + 17 * len(token_ids) + 7) % vocab_size
    return (token + 1) % vocab_size if token == eos_token_id else token


def draft_tokens(token_ids: list[int], k: int, vocab_size: int, eos_token_id: Optional[int]) -> list[int]:
    """The ``k`` draft tokens the stand-in drafter proposes after ``token_ids`` (pure): each is
    :func:`next_token` of the drafted sequence, except where the sequence's length is 3 modulo 4,
    where it is the token after that one (a wrong draft: it and every draft after it are
    rejected)."""
    sequence, drafts = list(token_ids), []
    for _ in range(k):
        token = next_token(sequence, vocab_size, eos_token_id)
        if len(sequence) % 4 == 3:
            token = (token + 1) % vocab_size
            token = (token + 1) % vocab_size if token == eos_token_id else token
        drafts.append(token)
        sequence.append(token)
    return drafts


def verify_drafts(token_ids: list[int], drafts, vocab_size: int, eos_token_id: Optional[int]) -> list[int]:
    """What a step with ``drafts`` scheduled after ``token_ids`` samples (pure): the drafts up to
    the first that differs from :func:`next_token`, then the next token after them."""
    sequence, accepted = list(token_ids), []
    for draft in drafts:
        if draft != next_token(sequence, vocab_size, eos_token_id):
            break
        accepted.append(draft)
        sequence.append(draft)
    return accepted + [next_token(sequence, vocab_size, eos_token_id)]


def model_kv_cache_specs(vllm_config) -> dict[str, object]:
    """The KV-cache spec of every layer of the configured model, as one TP rank reports it.
    Hybrid models of the Qwen3-Next family (``layer_types`` of ``full_attention`` and
    ``linear_attention``) and pure attention models are supported; ValueError otherwise."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    hf = model_config.hf_text_config
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    dtype = model_config.dtype if cache_config.cache_dtype == "auto" else cache_config.cache_dtype
    specs: dict[str, object] = {}
    mamba_spec = None
    for i, kind in enumerate(layer_types):
        name = f"model.layers.{i}"
        if kind == "full_attention":
            specs[name] = FullAttentionSpec(
                block_size=cache_config.block_size,
                num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
                head_size=model_config.get_head_size(),
                dtype=dtype if isinstance(dtype, torch.dtype) else model_config.dtype,
            )
        elif kind == "linear_attention":
            if mamba_spec is None:
                model_cls, _ = get_model_architecture(model_config)
                with set_current_vllm_config(vllm_config):
                    shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
                    dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
                mamba_spec = MambaSpec(
                    shapes=tuple(shapes), dtypes=tuple(dtypes), block_size=cache_config.mamba_block_size,
                    page_size_padded=cache_config.mamba_page_size_padded, mamba_type="gdn_attention",
                    mamba_cache_mode=cache_config.mamba_cache_mode,
                    num_speculative_blocks=vllm_config.num_speculative_tokens,
                )
            specs[name] = mamba_spec
        else:
            raise ValueError(f"layer {i} is a {kind!r} layer; the CPU staging executor models full_attention "
                             "and linear_attention layers")
    return specs


class _Rank:
    """One TP rank's worker state: its KV-cache spec and its V1 block tables (vLLM's class)."""

    def __init__(self, executor: "CpuStagingExecutor", rank: int) -> None:
        self.executor = executor
        self.rank = rank
        self.tables: Optional[MultiGroupBlockTable] = None
        self.rows: dict[str, int] = {}
        self.free_rows: list[int] = []

    # --- vLLM's worker RPCs -----------------------------------------------------------------

    def get_kv_cache_spec(self):
        return model_kv_cache_specs(self.executor.vllm_config)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        pass

    def determine_available_memory(self) -> int:
        return self.executor.kv_cache_bytes

    def initialize_from_config(self, kv_cache_configs) -> None:
        """Size this rank's tables as vLLM's model runner does (``max_num_blocks_per_req`` of each
        group's spec; Mamba rows unpadded, attention rows padded)."""
        vllm_config = self.executor.vllm_config
        config = kv_cache_configs[self.rank]
        max_len = vllm_config.model_config.max_model_len
        specs = [g.kv_cache_spec for g in config.kv_cache_groups]
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        self.tables = MultiGroupBlockTable(
            max_num_reqs=max_reqs,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            pin_memory=False,
            device=torch.device("cpu"),
            block_sizes=[s.block_size for s in specs],
            max_num_blocks=[s.max_num_blocks_per_req(vllm_config, max_len) for s in specs],
            cp_kv_cache_interleave_size=vllm_config.parallel_config.cp_kv_cache_interleave_size,
            slot_mapping_modes=[SlotMappingMode.NONE if isinstance(s, MambaSpec) else SlotMappingMode.TOKEN_TO_KV_SLOT
                                for s in specs],
        )
        self.free_rows = list(range(max_reqs - 1, -1, -1))
        if self.rank == 0:
            self.executor.check_host_memory(config.num_blocks)
            self.executor.start_content_model(config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def update_max_model_len(self, max_model_len: int) -> None:
        pass

    def execute_model(self, scheduler_output):
        self._update_tables(scheduler_output)
        return self.executor.run_step(scheduler_output) if self.rank == 0 else None

    def sample_tokens(self, grammar_output):
        return None

    def take_draft_token_ids(self):
        return self.executor.take_drafts() if self.rank == 0 else None

    def check_health(self) -> None:
        pass

    def reset_mm_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    # --- tables -----------------------------------------------------------------------------

    def _release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.tables.clear_row(row)
            self.free_rows.append(row)

    def _admit(self, request_id: str, block_ids) -> None:
        self._release(request_id)
        row = self.rows[request_id] = self.free_rows.pop()
        self.tables.add_row(block_ids, row)

    def _update_tables(self, out) -> None:
        """As vLLM's V1 model runner updates its persistent batch: finished and preempted
        requests leave, new and resumed ones get their whole row, running ones append."""
        for rid in (*out.finished_req_ids, *(out.preempted_req_ids or ())):
            self._release(rid)
        for new in out.scheduled_new_reqs:
            self._admit(new.req_id, new.block_ids)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids or rid not in self.rows:
                self._admit(rid, blocks)
            elif blocks is not None:
                self.tables.append_row(blocks, self.rows[rid])


class CpuStagingExecutor(Executor):
    """All TP ranks of a model-free engine, in the engine-core process (see the module
    docstring). Pass its dotted path as ``--distributed-executor-backend``."""

    uses_ray = False
    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """True where async scheduling was asked for (``--async-scheduling``). vLLM asks this
        while it resolves a config whose value is still the user's, and turns an unset one on
        when the executor supports it: a rehearsal stays synchronous, as vLLM's CPU platform has
        it, unless asked. (Read from the asking ``VllmConfig.__post_init__``'s frame; vLLM
        0.33.0 only, as every check here.)"""
        config = sys._getframe(1).f_locals.get("self")
        return getattr(getattr(config, "scheduler_config", None), "async_scheduling", None) is True

    def _init_executor(self) -> None:
        if self.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the CPU staging executor runs one pipeline stage; expected --pipeline-parallel-size 1")
        self.ranks = [_Rank(self, r) for r in range(self.parallel_config.tensor_parallel_size)]
        self.model: Optional[WorkerModel] = None
        self.sink: Optional[ViolationSink] = None
        self.vocab_size = self.model_config.get_vocab_size()
        self.eos_token_id = getattr(self.model_config.hf_text_config, "eos_token_id", None)
        self.step = 0
        spec = self.vllm_config.speculative_config
        self.num_draft_tokens = spec.num_speculative_tokens if spec is not None else 0
        self._proposals: Optional[DraftTokenIds] = None
        self._sampled: Optional[ModelRunnerOutput] = None  # the last step's, until sample_tokens
        self.kv_cache_bytes = self._kv_cache_bytes()

    def _kv_cache_bytes(self) -> int:
        """What each rank reports as free for the KV cache: vLLM's own --kv-cache-memory-bytes,
        else (with --num-gpu-blocks-override sizing the pool) ample, else the staged GPU
        memory times gpu_memory_utilization. No weights are loaded, so nothing is subtracted."""
        cache = self.cache_config
        if cache.kv_cache_memory_bytes:
            return cache.kv_cache_memory_bytes
        if cache.num_gpu_blocks_override is not None:
            return _AVAILABLE_WITH_OVERRIDE
        try:
            gpu, what = staged_gpu_memory()
        except ValueError as e:
            stop_report.record(str(e))
            raise
        kv = int(gpu * cache.gpu_memory_utilization)
        logger.info("kvproof: the CPU staging executor stages %s of GPU memory per rank; gpu_memory_utilization %g "
                    "gives the KV cache %.4g GiB, weights not subtracted (none are loaded; for a GPU run's exact pool "
                    "pass --num-gpu-blocks-override with the block count it logs)", what, cache.gpu_memory_utilization,
                    kv / 2**30)
        return kv

    def check_host_memory(self, num_blocks: int) -> None:
        """Refuse at start (one line, in the stop report) a pool whose bookkeeping this
        machine's memory cannot hold, before vLLM builds it."""
        need, have = num_blocks * HOST_BYTES_PER_BLOCK, available_memory()
        if have is None or need <= have:
            return
        message = (
            f"the CPU staging executor would stage {num_blocks:,} blocks per rank, about {need / 1e9:,.1f} GB of host "
            f"memory for vLLM's block pool and kvproof's checks ({HOST_BYTES_PER_BLOCK} bytes per block), but this "
            f"machine has {have / 1e9:.1f} GB available; pass --num-gpu-blocks-override {have // HOST_BYTES_PER_BLOCK:,} "
            f"or less, or a smaller {GPU_MEMORY_ENV} (or --kv-cache-memory-bytes)"
        )
        stop_report.record(message)
        raise ValueError(message)

    # --- RPCs -------------------------------------------------------------------------------

    def collective_rpc(self, method: str | Callable, timeout=None, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False):
        kwargs = kwargs or {}
        results = []
        for rank in self.ranks:
            if isinstance(method, str):
                if not hasattr(rank, method):
                    raise NotImplementedError(f"the CPU staging executor has no worker method {method!r}")
                results.append(getattr(rank, method)(*args, **kwargs))
            else:
                results.append(method(rank, *args, **kwargs))
        return _done(results) if non_block else results

    def execute_model(self, scheduler_output, non_block: bool = False):
        """Run the step; a step that scheduled tokens returns its sampled tokens from
        ``sample_tokens``, as vLLM's model runner does (the engine's batch queue waits on that)."""
        output = self.collective_rpc("execute_model", args=(scheduler_output,))[0]
        if scheduler_output.total_num_scheduled_tokens:
            self._sampled, output = output, None
        return _done(output) if non_block else output

    def sample_tokens(self, grammar_output, non_block: bool = False):
        output, self._sampled = self._sampled, None
        return _done(output) if non_block else output

    def check_health(self) -> None:
        pass

    @property
    def supported_tasks(self):
        return ("generate",)

    # --- the content model --------------------------------------------------------------------

    def start_content_model(self, kv_cache_config) -> None:
        self.model = WorkerModel(layout_from_vllm(kv_cache_config, self.vllm_config))
        self.sink = ViolationSink()

    def run_step(self, out) -> ModelRunnerOutput:
        """Mutates: apply one step to the content model, check its reads, sample."""
        self.step += 1
        check_copy_batch(out.kv_cache_block_copies or (), self.sink, f"step {self.step}")
        before = len(self.model.violations)
        self.model.run_step(out)
        for found in self.model.violations[before:]:
            inv_id, _, detail = found.partition(": ")
            self.sink.report(inv_id, f"step {self.step}, {detail}")
        self.sink.content_checked(sum(out.num_scheduled_tokens.values()))
        cached = out.scheduled_cached_reqs
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = out.scheduled_spec_decode_tokens or {}
        req_ids, sampled, proposed = [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            tokens = self.model.requests[rid].token_ids
            drafts = spec.get(rid, ())
            req_ids.append(rid)
            if starts[rid] + n - len(drafts) >= len(tokens):
                new = verify_drafts(tokens, drafts, self.vocab_size, self.eos_token_id)
                self.model.sampled(rid, new)
                sampled.append(new)
                if self.num_draft_tokens:
                    proposed.append(draft_tokens(tokens, self.num_draft_tokens, self.vocab_size, self.eos_token_id))
            else:
                sampled.append([])
                proposed.append([])
        if self.num_draft_tokens:
            self._proposals = DraftTokenIds(req_ids, proposed)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def take_drafts(self) -> Optional[DraftTokenIds]:
        """Mutates: the drafts proposed after the last step (once), or None without speculative
        decoding."""
        proposals, self._proposals = self._proposals, None
        return proposals


def _keep_async_scheduling() -> None:
    """vLLM's CPU platform turns async scheduling off in every config (``check_and_update_config``:
    "not required on CPU"), after vLLM has checked that the executor supports it. A deployment
    staged with this executor rehearses a GPU's, so an explicit ``--async-scheduling`` is kept.
    Installed when this module is imported: vLLM imports it to resolve the executor class,
    before the platform's update."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "_kvproof_keeps_async", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        asked = vllm_config.scheduler_config.async_scheduling  # True only if asked: supports_async_scheduling
        original(cls, vllm_config)
        backend = vllm_config.parallel_config.distributed_executor_backend
        if asked is True and (backend is CpuStagingExecutor or backend == f"{__name__}.CpuStagingExecutor"):
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config._kvproof_keeps_async = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


_keep_async_scheduling()


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
