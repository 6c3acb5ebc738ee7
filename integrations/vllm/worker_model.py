"""What every DCP rank's KV cache holds, computed from vLLM's ``SchedulerOutput`` alone, with
kvproof's content oracle (``kvproof.oracle.content_oracle``) checking every read.

The model follows vLLM 0.33.0's worker: finished requests leave first; a new or resumed request
gets its whole row (``overwrite``), a running one appends the step's new block ids; the step's
copy-on-write copies run on every rank as one gather-then-scatter, before the forward pass; the
forward writes each scheduled token's KV (or a Mamba chunk's end state) and reads what
attention / the recurrence needs. vLLM's copies carry no group (one pool: a block id names the
same block in every group's tensors), so each copy is applied in every group.

Draft tokens (speculative decoding) are written as what they are: a step with drafts writes
the KV of the request's tokens followed by its drafts, so a rejected draft's KV is another
prefix's and any later read of it is a violation; once the step's output says how many were
accepted (``sampled``), the Mamba state after the last accepted token is the request's state
(``ContentOracle.keep_state``).

The worker never sees a request's cache salt (vLLM folds it into the block hashes only), so
prefix identities here are token prefixes: the oracle catches wrong, stale and not-yet-written
reads, not a hit across two tenants with identical tokens (the hashes separate those).
"""

from __future__ import annotations

from kvproof.impl.scheduler import ScheduledChunk, StepPlan
from kvproof.oracle.content_oracle import ContentOracle
from kvproof.spec.layout import Layout


class _Tokens:
    """The request view the oracle reads: id, known tokens, salt (unknown to a worker)."""

    __slots__ = ("request_id", "token_ids", "cache_salt")

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.cache_salt = None


class WorkerModel:
    """One model of all DCP ranks of one engine. ``run_step`` mutates; ``violations`` lists what
    the oracle found (``INV-CONTENT-KV``, ``INV-CONTENT-STATE``, ``INV-TABLE-WIDTH``)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.oracle = ContentOracle(layout)
        self.requests: dict[str, _Tokens] = {}
        #: request -> (first position, drafts) of its step that ran drafts, until its output
        self._drafted: dict[str, tuple[int, int]] = {}
        self.num_groups = len(layout.groups)
        self.step = 0

    @property
    def violations(self) -> list[str]:
        return self.oracle.violations

    def run_step(self, out) -> None:
        """Apply one ``SchedulerOutput`` (rows, copies, writes, checked reads)."""
        self.step += 1
        for rid in out.finished_req_ids:
            req = self.requests.pop(rid, None)
            self._drafted.pop(rid, None)
            if req is not None:
                self.oracle.forget(req)
        chunks = []
        n = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            req = self.requests[new.req_id] = _Tokens(new.req_id, list(new.prompt_token_ids))
            chunks.append(ScheduledChunk(req, new.num_computed_tokens, n[new.req_id], new.block_ids, True))
        cached = out.scheduled_cached_reqs
        spec = out.scheduled_spec_decode_tokens or {}
        for i, rid in enumerate(cached.req_ids):
            req = self.requests[rid]
            resumed = rid in cached.resumed_req_ids
            blocks = cached.new_block_ids[i] or tuple([] for _ in range(self.num_groups))
            drafts = spec.get(rid)
            if drafts:  # the KV written is that of the tokens followed by the drafts
                self._drafted[rid] = (cached.num_computed_tokens[i], len(drafts))
                req = _Tokens(rid, req.token_ids + list(drafts))
            chunks.append(ScheduledChunk(req, cached.num_computed_tokens[i], n[rid], blocks, resumed))
        order = {rid: k for k, rid in enumerate(n)}  # vLLM's scheduling order
        chunks.sort(key=lambda c: order[c.request.request_id])
        copies = [(g, c.src_block_id, c.dst_block_id)
                  for c in (out.kv_cache_block_copies or ()) for g in range(self.num_groups)]
        self.oracle.run_step(StepPlan(self.step, chunks, copies, []))

    def sampled(self, request_id: str, token_ids) -> None:
        """Mutates: the tokens the runner sampled for ``request_id`` become known tokens (after
        a step with drafts: the accepted drafts and one more)."""
        req = self.requests[request_id]
        req.token_ids.extend(token_ids)
        drafted = self._drafted.pop(request_id, None)
        if drafted is not None:
            start, _ = drafted
            self.oracle.keep_state(req, start + len(token_ids))


class OracleHook:
    """An ``engine_harness.StepHook`` (by its methods: this module stays free of the harness)
    that runs a :class:`WorkerModel` beside the harness: every step the scheduler plans is
    applied to the model of all ranks, and the stand-in runner's samples become known tokens.
    ``violations_by_step`` maps a step to what the oracle found."""

    def __init__(self, layout: Layout) -> None:
        self.worker = WorkerModel(layout)
        self.violations_by_step: dict[int, list[str]] = {}

    def scheduled(self, harness, step, output) -> None:
        before = len(self.worker.violations)
        self.worker.run_step(output)
        if len(self.worker.violations) > before:
            self.violations_by_step[step] = self.worker.violations[before:]

    def sampled(self, harness, output, runner_output) -> None:
        """The runner's samples are known tokens on the workers at once (with async scheduling,
        before the Scheduler sees them: the next step's input is the last sample)."""
        for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            if tokens and rid in self.worker.requests:
                self.worker.sampled(rid, tokens)

    def updated(self, harness, record, output, runner_output) -> None:
        """Nothing: the samples came in ``sampled``."""
