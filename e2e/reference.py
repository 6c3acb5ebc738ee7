"""The reference: every request recomputed from scratch, one request at a time, with dense
causal attention over its whole prefix and the recurrence from a zero state. No cache, no
block table, no DCP -- what the served logits must equal."""

from __future__ import annotations

import torch

from kvproof.e2e.model import DTYPE, TinyHybridModel


def reference_logits(model: TinyHybridModel, tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), V]`` of every position of one sequence, computed densely."""
    n = len(tokens)
    positions = torch.arange(n, dtype=torch.int64)
    x = model.embed(torch.tensor(tokens, dtype=torch.int64), positions)  # [n, d]
    c = model.config
    for spec in model.layers:
        h = model.norm(x)
        if spec.recurrent:
            q, k, v, decay, beta = model.recurrent_inputs(spec.index, h)
            zero = torch.zeros(c.heads, c.head_dim, c.head_dim, dtype=DTYPE)
            heads, _ = model.delta_rule_scan(zero, q, k, v, decay, beta)
        else:
            q, k, v = (model.project(spec.index, h, name) for name in ("q", "k", "v"))
            heads, _ = model.attention_partial(q, positions, k, v, positions)
        x = x + model.output(spec.index, heads)
    return model.logits(x)


def computed_tokens(prompt: tuple[int, ...], output: tuple[int, ...]) -> list[int]:
    """The tokens whose positions a served request computes: its prompt and every output but
    the last (the last sampled token's KV is never computed, docs/replay.md)."""
    return list(prompt) + list(output[:-1])
