"""A plan as JSON (``--json``) and as text: one row per configuration, then the recommendation
and the diagnoses."""

from __future__ import annotations

import textwrap

from kvproof.planner.memory import gib
from kvproof.planner.plan import PlanResult, serve_command_for
from kvproof.planner.run import ConfigReport


def _wrap_list(head: str, items: list[str], width: int = 100) -> list[str]:
    """``head`` and the comma-separated ``items``, broken between items to fit ``width``."""
    lines, line = [], head
    for k, item in enumerate(items):
        piece = item + ("," if k < len(items) - 1 else "")
        if len(line) + len(piece) > width and line.strip():
            lines.append(line.rstrip())
            line = "  "
        line += piece + " "
    return lines + [line.rstrip()]


def config_to_json(r: ConfigReport) -> dict:
    out = {
        "dcp": r.dcp,
        "kv_memory_gib": None if r.kv_memory_bytes is None else round(gib(r.kv_memory_bytes), 6),
        "num_blocks": r.num_blocks,
        "block_bytes": r.block_bytes,
        "hash_block_size": r.hash_block_size,
        "cache_hit_alignment": r.cache_hit_alignment,
        "requests": r.requests,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "hit_rate": round(r.hit_rate, 6),
        "attention_hit_rate": None if r.attention_hit_rate is None else round(r.attention_hit_rate, 6),
        "requests_with_hit": r.requests_with_hit,
        "prefill_tokens": r.prefill_tokens,
        "cow_copies": r.cow_copies,
        "evictions": r.evictions,
        "preemptions": r.preemptions,
        "steps": r.steps,
        "table_bytes_per_group": r.table_bytes_per_group,
        "largest_request": r.largest_request,
        "violations": r.violations,
        "seconds": round(r.seconds, 3),
        "engine": r.engine,
        "eviction": r.eviction,
        "checkpoints": r.checkpoints,
    }
    if r.halves is not None:
        out["hit_rate_by_half"] = [round(h, 6) for h in r.halves]
    if r.notes:
        out["notes"] = r.notes
    if r.peak_blocks_per_group is not None:
        out["peak_blocks_per_group"] = r.peak_blocks_per_group
    if r.peak_blocks is not None:
        out["peak_blocks"] = r.peak_blocks
    if r.block_size is not None:
        out["block_size"] = r.block_size
    return out


def plan_to_json(result: PlanResult) -> dict:
    req = result.request
    base = result.layouts[req.dcps[0]]
    return {
        "workload": {
            "description": req.workload.description,
            "requests": len(req.workload),
            "prompt_tokens": req.workload.prompt_tokens,
        },
        "layout": {
            "groups": [g.group.label for g in base.groups],
            "max_model_len": base.config.max_model_len,
            "retention_interval": base.config.retention_interval,
            "attention_keys": base.config.attention_keys,
            "max_num_batched_tokens": req.options.max_num_batched_tokens,
            "max_num_seqs": req.options.max_num_seqs,
            "vllm_groups_per_group": list(result.vllm_groups),
            "eviction": list(req.policies),
            "checkpoints": list(req.checkpoints),
        },
        "model": None if req.model is None else req.model.to_json(),
        "engine": "kvproof",
        "oracle": req.options.oracle,
        "configs": [{**config_to_json(r), "serve": _row_command(result, r)} for r in result.reports],
        "stock_configs": [{**config_to_json(r), "serve": _row_command(result, r)} for r in result.stock_reports],
        "vllm_configs": [{**config_to_json(r), "serve": _row_command(result, r)} for r in result.vllm_reports],
        "memory_sweep": [config_to_json(r) for r in result.sweep],
        "checkpoint_configs": [config_to_json(r) for r in result.checkpoint_reports],
        "reuse_bound": {str(u): round(f, 6) for u, f in sorted(result.reuse.items())},
        "reuse_bound_prompt_tokens": result.reuse_tokens,
        "notes": result.notes,
        "recommendation": result.recommendation,
        "diagnoses": [d.to_json() for d in result.diagnoses],
        "seconds": round(result.seconds, 3),
    }


#: What each engine of a plan's rows runs, in words.
ENGINE_LEGEND = {
    "kvproof": "kvproof's manager and scheduler, replayed; the manager serves inside vLLM with:",
    "stock": "stock vLLM 0.33.0 with the same flags, replayed under vLLM's rules (docs/plan.md):",
    "vllm": "vLLM 0.33.0's own Scheduler and KV-cache manager (stock vLLM), run on the CPU:",
    "kvproof-vllm": "vLLM's own Scheduler with kvproof's manager inside it, run on the CPU:",
}


def _row_command(result: PlanResult, r: ConfigReport) -> str:
    """The ``vllm serve`` command that reproduces row ``r``: stock vLLM's for the stock rows and
    vLLM's own engine, kvproof's manager inside vLLM for the others."""
    manager = "vllm" if r.engine in ("vllm", "stock") else "kvproof"
    return serve_command_for(result.request, r.dcp, r.eviction, r.kv_memory_bytes, manager, r.checkpoints,
                             r.block_size).text()


def _engine_rows(result: PlanResult) -> list[ConfigReport]:
    """Every row of the main table, by block size (``--block-size``'s order), DCP size, then engine
    (``ENGINE_LEGEND``'s order), then eviction policy."""
    policies, checkpoints = result.request.policies, result.request.checkpoints
    blocks = result.request.block_sizes
    order = list(ENGINE_LEGEND)
    return sorted(result.reports + result.stock_reports + result.vllm_reports,
                  key=lambda r: (blocks.index(r.block_size), r.dcp, order.index(r.engine), policies.index(r.eviction) if r.eviction in policies else 0,
                                 checkpoints.index(r.checkpoints) if r.checkpoints in checkpoints else 0))


def _engine_lines(result: PlanResult) -> list[str]:
    """One line per engine in the rows, saying what it runs, and the command of its first row
    (the others differ in the DCP size, or the eviction policy)."""
    lines = []
    rows = _engine_rows(result)
    for engine in ENGINE_LEGEND:
        mine = [r for r in rows if r.engine == engine]
        if mine:
            lines.append(f"  {engine}: {ENGINE_LEGEND[engine]}")
            firsts = {r.checkpoints: r for r in reversed(mine)}  # one command per checkpoint policy served
            lines += ([f"    {_row_command(result, firsts[c])}" for c in result.request.checkpoints if c in firsts]
                      or [f"    {_row_command(result, mine[0])}"])
    return lines


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _by_block(result: PlanResult, rows: list[list[str]], reports: list[ConfigReport]) -> str:
    """``rows`` (a header, then one row per report) as one table; with several block sizes each
    block size's rows under a line naming it and its layout (a column would not fit 100)."""
    req = result.request
    lines = _table(rows).split("\n")
    if len(req.block_sizes) < 2:
        return "\n".join(lines)
    out, last = lines[:1], object()
    for line, r in zip(lines[1:], reports):
        if r.block_size != last:
            last = r.block_size
            out.append(f"--block-size {r.block_size} ({_labels(req.config_for(r.block_size))}):")
        out.append(line)
    return "\n".join(out)


def _labels(config) -> str:
    return ", ".join(g.label for g in config.groups)


def _group_names(layout) -> list[str]:
    """Each layout group by its kind, numbered where a kind repeats."""
    kinds = [g.group.kind.value for g in layout.groups]
    return [k if kinds.count(k) == 1 else f"{k}{kinds[:i + 1].count(k)}" for i, k in enumerate(kinds)]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _checkpoint_rows(result: PlanResult, several: bool) -> list[list[str]]:
    """One row per checkpoint policy, DCP size and eviction policy: the hit rate, attention's, their
    ratio, the ratio to the plan's own policy (and to stock vLLM where it ran), and the peak
    blocks attention and Mamba groups held."""
    req = result.request
    base = result.layouts[req.dcps[0]]
    mamba = [g.group.kind.value == "mamba" for g in base.groups]
    own = {(r.dcp, r.eviction): r for r in result.reports}
    stock = {r.dcp: r for r in result.vllm_reports if r.engine == "vllm"}
    rows = [["checkpoints"] + (["eviction"] if several else []) + ["DCP", "hit rate", "attn alone", "ratio",
            f"x {req.checkpoints[0]}"] + (["x stock vllm"] if stock else []) + ["peak attn/mamba", "evictions"]]
    ordered = sorted(result.reports + result.checkpoint_reports,
                     key=lambda r: (r.dcp, req.policies.index(r.eviction), req.checkpoints.index(r.checkpoints)))
    for r in ordered:
        first = own.get((r.dcp, r.eviction))
        attn = r.attention_hit_rate
        peaks = r.peak_blocks_per_group
        rows.append([r.checkpoints] + ([r.eviction] if several else []) + [
            str(r.dcp), f"{100 * r.hit_rate:.1f} %", "-" if attn is None else f"{100 * attn:.1f} %",
            f"{r.hit_rate / attn:.2f}" if attn else "-",
            f"{r.cached_tokens / first.cached_tokens:.2f}" if first is not None and first.cached_tokens else "-",
        ] + ([f"{r.cached_tokens / stock[r.dcp].cached_tokens:.2f}" if r.dcp in stock and stock[r.dcp].cached_tokens
              else "-"] if stock else []) + [
            "-" if peaks is None else f"{sum(b for b, m in zip(peaks, mamba) if not m):,}/{sum(b for b, m in zip(peaks, mamba) if m):,}",
            f"{r.evictions:,}",
        ])
    return rows


def _served_checkpoint_rows(result: PlanResult, several: bool) -> list[list[str]]:
    """kvproof's manager in vLLM's Scheduler, one row per checkpoint policy, DCP size and eviction
    policy: the hit rate, against the plan's own policy there and against stock vLLM's Scheduler
    and manager in the same run."""
    req = result.request
    served = [r for r in result.vllm_reports if r.engine == "kvproof-vllm"]
    own = {(r.dcp, r.eviction): r for r in served if r.checkpoints == req.checkpoints[0]}
    stock = {r.dcp: r for r in result.vllm_reports if r.engine == "vllm"}
    rows = [["checkpoints"] + (["eviction"] if several else []) + ["DCP", "hit rate", f"x {req.checkpoints[0]}",
                                                                   "x stock vllm", "evictions"]]
    for r in sorted(served, key=lambda r: (r.dcp, req.policies.index(r.eviction), req.checkpoints.index(r.checkpoints))):
        first, base = own.get((r.dcp, r.eviction)), stock.get(r.dcp)
        rows.append([r.checkpoints] + ([r.eviction] if several else []) + [
            str(r.dcp), f"{100 * r.hit_rate:.1f} %",
            f"{r.cached_tokens / first.cached_tokens:.2f}" if first is not None and first.cached_tokens else "-",
            f"{r.cached_tokens / base.cached_tokens:.2f}" if base is not None and base.cached_tokens else "-",
            f"{r.evictions:,}",
        ])
    return rows


def plan_to_text(result: PlanResult) -> str:
    req = result.request
    base = result.layouts[req.dcps[0]]
    lines = []
    if req.model is not None:
        first, second = req.model.describe()
        lines += [f"model: {first}", f"       {second}"]
    lines += [
        f"workload: {req.workload.description}",
        f"          {req.workload.prompt_tokens:,} prompt tokens",
        f"layout: {', '.join(g.group.label for g in base.groups)}; max-model-len {base.config.max_model_len:,}; "
        f"retention {'none' if base.config.retention_interval is None else base.config.retention_interval}",
        f"run: budget {req.options.max_num_batched_tokens:,} tokens/step"
        + (" with the content oracle" if req.options.oracle else ""),
    ]
    blocks = req.block_sizes
    if len(blocks) > 1:
        lines.append("block sizes compared: " + "; ".join(f"{b} ({_labels(req.config_for(b))})" for b in blocks))
    for i, b in enumerate(blocks):
        r0 = next((r for r in result.reports if r.block_size == b), None)
        if r0 is None or not r0.block_bytes:
            continue
        mem = f"{gib(r0.kv_memory_bytes):.4g} GiB per GPU -> " if r0.kv_memory_bytes is not None else ""
        at = f" at --block-size {b}" if len(blocks) > 1 else ""
        lines.append(f"{'      ' if i else 'pool: '}{mem}{r0.num_blocks:,} blocks of {_mib(r0.block_bytes)} MiB{at}"
                     + ("" if i else " (as vLLM's KV planner sizes it)"))
    several = len(req.policies) > 1
    served_policies = len({r.checkpoints for r in result.vllm_reports}) > 1
    by_dcp = _engine_rows(result)

    def first(r: ConfigReport) -> list[str]:
        return [r.engine] + ([r.checkpoints] if served_policies else []) + ([r.eviction] if several else []) + [str(r.dcp)]

    key = ["engine"] + (["checkpoints"] if served_policies else []) + (["eviction"] if several else []) + ["DCP"]
    rows = [key + ["hit rate", "attn alone", "req w/ hit", "prefill tok", "CoW", "evictions", "preempt", "violations"]]
    for r in by_dcp:
        rows.append(first(r) + [
            f"{100 * r.hit_rate:.1f} %", "-" if r.attention_hit_rate is None else f"{100 * r.attention_hit_rate:.1f} %",
            f"{r.requests_with_hit:,}/{r.requests:,}", f"{r.prefill_tokens:,}", f"{r.cow_copies:,}",
            f"{r.evictions:,}", f"{r.preemptions:,}", str(len(r.violations)),
        ])
    lines += ["", _by_block(result, rows, by_dcp)]
    if result.checkpoint_reports:
        lines += ["", "checkpoint policies (kvproof's engine; hybrid hit rate against attention alone in the same run, "
                  f"and against the first policy, {req.checkpoints[0]}):", _table(_checkpoint_rows(result, several))]
    if served_policies:
        lines += ["", "checkpoint policies in vLLM's Scheduler (kvproof's manager, KVPROOF_MANAGER=kvproof; against "
                  f"the first policy, {req.checkpoints[0]}, and stock vLLM's Scheduler and manager in the same run):",
                  _table(_served_checkpoint_rows(result, several))]
    lines += ["engines, and the command of each one's first row (the others differ in the "
              + ("DCP and block size" if len(blocks) > 1 else "DCP size") + "):"]
    lines += _engine_lines(result)
    # Per group (named by kind): the most blocks held at once, and the block tables on one GPU.
    names = _group_names(base)
    has_peak = all(r.peak_blocks_per_group is not None for r in result.reports)
    rows = [key + ([f"peak {n}" for n in names] if has_peak else []) + [f"tables {n}" for n in names] + ["largest req"]]
    for r in by_dcp:
        peaks = [f"{b:,}" for b in r.peak_blocks_per_group] if r.peak_blocks_per_group else ["-"] * len(names)
        rows.append(first(r) + (peaks if has_peak else []) + [f"{_mib(b)} MiB" for b in r.table_bytes_per_group]
                    + [f"{r.largest_request:,}"])
    lines += ["", "per GPU: peak blocks held and block tables, per group; the longest request that fits:",
              _by_block(result, rows, by_dcp)]
    warm = [r for r in result.reports if r.halves is not None]
    if warm:
        lines += ["", "warm-up, hit rate of the first and second half of the requests (a cold cache shows first):"]
        for b in blocks:  # one line per block size
            mine = sorted((r for r in warm if r.block_size == b), key=lambda r: r.dcp)
            if mine:
                lines.append(("  " if len(blocks) < 2 else f"  block {b}: ") + ", ".join(
                    f"DCP {r.dcp}" + (f" {r.eviction}" if several else "")
                    + f" {100 * r.halves[0]:.1f} -> {100 * r.halves[1]:.1f} %" for r in mine))
    notes = sorted({f"vLLM at DCP {r.dcp}: {n}" for r in result.vllm_reports for n in r.notes})
    lines += [f"note: {n}" for n in notes]
    if result.sweep:
        columns = [(d, e) for d in sorted({r.dcp for r in result.sweep}) for e in req.policies]
        sizes = sorted({r.kv_memory_bytes or 0 for r in result.sweep})
        grid = {(r.dcp, r.eviction, r.kv_memory_bytes or 0): r for r in result.sweep}
        rows = [["GiB/GPU"] + [f"DCP {d}" + (f" {e}" if several else "") for d, e in columns]]
        for s in sizes:
            rows.append([f"{gib(s):.4g}"] + [f"{100 * grid[(d, e, s)].hit_rate:.1f} %" if (d, e, s) in grid else "-" for d, e in columns])
        lines += ["", "hit rate by KV memory per GPU:", _table(rows)]
        if several:
            rows = [["GiB/GPU"] + [f"DCP {d} {e}" for d, e in columns]]
            for s in sizes:
                rows.append([f"{gib(s):.4g}"] + [f"{grid[(d, e, s)].prefill_tokens:,}" if (d, e, s) in grid else "-" for d, e in columns])
            lines += ["", "prefill tokens computed by KV memory per GPU:", _table(rows)]
    if result.reuse:
        total = req.workload.prompt_tokens
        part = f" (over its first {result.reuse_tokens:,} of {total:,} prompt tokens)" if result.reuse_tokens < total else ""
        items = [f"{100 * f:.1f} % in {u:,}-token steps" for u, f in sorted(result.reuse.items())]
        lines += [""] + _wrap_list(f"reuse the traffic allows with an unbounded cache{part}: ", items)
    rec = result.recommendation
    lines += [""] + result.notes + [f"recommendation: {rec.get('head', rec['text'])}"]
    lines += [line for n in rec.get("notes", ()) for line in textwrap.wrap(n, 98, initial_indent="  ", subsequent_indent="    ")]
    if "serve" in rec:
        lines.append(f"  {rec['serve']}")
        if "stock_hit_rate" in rec:
            lines.append(f"  stock vLLM with the same flags ({'this command' if rec['stock_serve'] == rec['serve'] else 'no KVPROOF_MANAGER'}): "
                         f"{100 * rec['stock_hit_rate']:.1f} %")
        if "served_hit_rate" in rec:
            served = rec["served_hit_rate"]
            lines.append(f"  in vLLM's Scheduler this command measured {100 * served['this command']:.1f} %, "
                         f"stock vLLM {100 * served['stock vllm']:.1f} %")
        elif rec["serve"].startswith("KVPROOF_MANAGER="):
            lines.append("  (kvproof's manager inside vLLM, docs/vllm.md; --engine vllm measures this command)")
        if rec["not_reproduced"]:
            lines.append("  these numbers use kvproof's rules, which stock vLLM lacks:")
            lines += [f"    {n}" for n in rec["not_reproduced"]]
    if result.diagnoses:
        lines.append("diagnoses:")
        lines += [f"  [{d.id}] {d.message}" for d in result.diagnoses]
    else:
        lines.append("diagnoses: none")
    bad = [v for r in result.reports + result.sweep for v in r.violations]
    if bad:
        lines.append(f"{len(bad)} invariant violation(s):")
        lines += [f"  {v}" for v in bad]
    else:
        lines.append("invariant violations: none")
    return "\n".join(lines)
