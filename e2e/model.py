"""A tiny hybrid model in float64 with seeded random weights: token embedding plus sinusoidal
positions, then residual layers that are either causal softmax attention or a gated delta rule
(the linear-recurrence family of Kimi Linear / Qwen3-Next), then an LM head.

This module holds only the math that is the same with or without a cache: projections, the
attention of a query block over given keys, the delta-rule scan from a given state, norms and
the head. Where KV and state come from is the caller's business -- :mod:`kvproof.e2e.worker`
reads them through kvproof's block tables, :mod:`kvproof.e2e.reference` recomputes everything.

Shapes use: T tokens, H heads, Dh head dim (attention and recurrence alike), d hidden size,
L keys, V output vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout

DTYPE = torch.float64


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny model. Token ids index the embedding modulo ``vocab_in``, so any
    trace's ids work; logits are over ``vocab_out`` classes (they are only compared, never
    sampled: outputs come from the trace)."""

    hidden: int = 16
    heads: int = 2
    head_dim: int = 8
    layers_per_group: int = 2
    vocab_in: int = 4096
    vocab_out: int = 64
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Layer ``index`` of the model: its kind, the cache group whose blocks it uses, and the
    memory slot it shares with one layer of every other group (vLLM's hybrid allocator: one
    buffer per block id, viewed by each group's layer as its own page)."""

    index: int
    recurrent: bool
    group: int
    slot: int


def layer_specs(layout: Layout, layers_per_group: int) -> tuple[LayerSpec, ...]:
    """Layers round robin over the layout's groups: slot 0 holds one layer of every group,
    then slot 1, ... Raises ValueError for a group kind the e2e model has no layer for."""
    for g in layout.groups:
        if g.group.kind is GroupKind.SLIDING_WINDOW:
            raise ValueError(
                f"group {g.index} ({g.group.label}): the e2e model has full-attention, MLA and Mamba layers; "
                "sliding-window groups are not supported"
            )
        if not g.group.prefix_cacheable:
            # Mode 'none' keeps one running state that no request can reuse: the model's state
            # indexing (row[cdiv(n, B) - 1]) is the align-mode layout.
            raise ValueError(
                f"group {g.index} ({g.group.label}): Mamba cache mode 'none' is not supported by the e2e "
                "model (its state is never served from the cache); expected mode 'align'"
            )
    specs = []
    for slot in range(layers_per_group):
        for g in layout.groups:
            specs.append(LayerSpec(len(specs), g.group.kind is GroupKind.MAMBA, g.index, slot))
    return tuple(specs)


class TinyHybridModel:
    """Seeded random weights; identical on every rank and in the reference (same seed, CPU,
    float64). Immutable after construction."""

    def __init__(self, config: ModelConfig, layers: tuple[LayerSpec, ...]) -> None:
        self.config = config
        self.layers = layers
        gen = torch.Generator().manual_seed(config.seed)
        d, hd = config.hidden, config.heads * config.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen, dtype=DTYPE) / math.sqrt(rows)

        self.embedding = torch.randn(config.vocab_in, d, generator=gen, dtype=DTYPE)  # [vocab_in, d]
        self.lm_head = weight(d, config.vocab_out)  # [d, V]
        # Per layer: q, k, v projections [d, H*Dh] and the output projection [H*Dh, d];
        # recurrent layers add the decay gate and the delta-rule step size, [d, H] each.
        self.weights = []
        for spec in layers:
            w = {"q": weight(d, hd), "k": weight(d, hd), "v": weight(d, hd), "o": weight(hd, d)}
            if spec.recurrent:
                w["decay"] = weight(d, config.heads)
                w["beta"] = weight(d, config.heads)
            self.weights.append(w)

    # --- shared pieces ------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens``, ``positions``: int64 ``[T]`` -> hidden states ``[T, d]``. Sinusoidal
        positions make every token's KV depend on where it sits, so a KV read from the wrong
        position shows in the logits."""
        d = self.config.hidden
        freqs = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=DTYPE) / d)  # [d/2]
        angles = positions.to(DTYPE)[:, None] * freqs[None, :]  # [T, d/2]
        pos = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)  # [T, d]
        return self.embedding[tokens % self.config.vocab_in] + pos

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        """RMS norm without weights. ``x``: ``[T, d]``."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, d]`` -> ``[T, V]``."""
        return self.norm(x) @ self.lm_head

    def project(self, layer: int, x: torch.Tensor, name: str) -> torch.Tensor:
        """Projection ``name`` (q, k or v) of normed ``x`` ``[T, d]`` -> ``[T, H, Dh]``."""
        c = self.config
        return (x @ self.weights[layer][name]).view(-1, c.heads, c.head_dim)

    def output(self, layer: int, heads: torch.Tensor) -> torch.Tensor:
        """Per-head outputs ``[T, H, Dh]`` -> residual update ``[T, d]``."""
        return heads.reshape(heads.shape[0], -1) @ self.weights[layer]["o"]

    # --- attention ------------------------------------------------------------------------------

    def attention_partial(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal softmax attention of queries over a subset of the keys.

        ``q``: ``[T, H, Dh]`` at global positions ``q_pos`` int64 ``[T]``; ``k``, ``v``:
        ``[L, H, Dh]`` at global positions ``k_pos`` int64 ``[L]`` (any subset, any order).
        Returns ``(out, lse)``: ``out`` ``[T, H, Dh]`` normalised over the visible keys of the
        subset (0 where none is visible) and ``lse`` ``[T, H]`` their log-sum-exp (-inf where
        none). Partials over disjoint key subsets merge exactly with :func:`merge_partials`.
        """
        scores = torch.einsum("thd,lhd->thl", q, k) / math.sqrt(self.config.head_dim)  # [T, H, L]
        visible = k_pos[None, :] <= q_pos[:, None]  # [T, L]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [T, H]
        weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0
        return torch.einsum("thl,lhd->thd", weights, v), lse

    # --- gated delta rule -----------------------------------------------------------------------

    def recurrent_inputs(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Normed ``x`` ``[T, d]`` -> ``(q, k, v, decay, beta)``: ``q``, ``k`` L2-normalised
        per head ``[T, H, Dh]``, ``v`` ``[T, H, Dh]``, ``decay`` in (0, 1) and ``beta`` in
        (0, 1), ``[T, H]`` each."""
        w = self.weights[layer]
        q = torch.nn.functional.normalize(self.project(layer, x, "q"), dim=-1)
        k = torch.nn.functional.normalize(self.project(layer, x, "k"), dim=-1)
        v = self.project(layer, x, "v")
        decay = torch.exp(-torch.nn.functional.softplus(x @ w["decay"]))
        beta = torch.sigmoid(x @ w["beta"])
        return q, k, v, decay, beta

    @staticmethod
    def delta_rule_scan(state: torch.Tensor, q, k, v, decay, beta) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the gated delta rule over one sequence's tokens from ``state`` ``[H, Dh, Dh]``
        (keys x values; zeros for an empty prefix). Inputs as from :meth:`recurrent_inputs`
        for those tokens. Returns ``(out [T, H, Dh], final state [H, Dh, Dh])``; does not
        mutate ``state``. Per token: ``S <- a S;  S <- S + beta k (v - S^T k)^T;  o = S^T q``."""
        s = state.clone()
        out = torch.empty_like(v)
        for t in range(v.shape[0]):
            s = s * decay[t][:, None, None]
            remembered = torch.einsum("hkv,hk->hv", s, k[t])
            s = s + torch.einsum("hk,hv->hkv", k[t], (v[t] - remembered) * beta[t][:, None])
            out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        return out, s


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact merge of attention partials over disjoint key sets (one per DCP rank).

    ``outs[r]``: ``[T, H, Dh]``, ``lses[r]``: ``[T, H]`` (-inf where rank r saw no key).
    ``softmax over all keys = sum_r exp(lse_r - lse) * softmax over rank r's keys``, with
    ``lse = logsumexp_r lse_r``. Every query sees at least itself, so ``lse`` is finite.
    """
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # [T, H]
    total = torch.zeros_like(outs[0])
    for out, part in zip(outs, lses):
        total += torch.exp(part - lse)[..., None] * out
    return total
