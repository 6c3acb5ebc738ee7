"""The e2e model's pieces on their own: the exact log-sum-exp merge, the inverse of the DCP
placement that attention reads by, and the batched copy semantics."""

from __future__ import annotations

import pytest
import torch

from kvproof.e2e.model import DTYPE, ModelConfig, TinyHybridModel, layer_specs, merge_partials
from kvproof.e2e.paged_cache import PagedCache
from kvproof.e2e.worker import ChunkWork, Worker, WorkerStep, owned_positions
from kvproof.spec.layout import resolve_layout
from kvproof.spec.placement import local_position, owner_rank

from .conftest import layout_config


def _model(config):
    layout = resolve_layout(config)
    return layout, TinyHybridModel(ModelConfig(), layer_specs(layout, 2))


@pytest.mark.parametrize("dcp", [1, 2, 3, 4])
def test_partials_over_disjoint_keys_merge_to_dense_attention(dcp):
    _, model = _model(layout_config())
    gen = torch.Generator().manual_seed(dcp)
    q, k, v = (torch.randn(n, 2, 8, generator=gen, dtype=DTYPE) for n in (5, 23, 23))
    q_pos, k_pos = torch.arange(18, 23), torch.arange(23)
    dense, _ = model.attention_partial(q, q_pos, k, v, k_pos)
    owner = k_pos % dcp  # any split works, including ranks that see no visible key
    parts = [model.attention_partial(q, q_pos, k[owner == r], v[owner == r], k_pos[owner == r]) for r in range(dcp)]
    merged = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    assert float((merged - dense).abs().max()) <= 1e-14


@pytest.mark.parametrize("dcp, interleave, block_size", [(2, 1, 4), (2, 2, 4), (4, 1, 8), (3, 2, 4)])
def test_owned_positions_invert_the_placement(dcp, interleave, block_size):
    for n in range(0, 3 * block_size * dcp + 3):
        for rank in range(dcp):
            expected = [p for p in range(n) if owner_rank(p, dcp, interleave) == rank]
            got = owned_positions(n, block_size, dcp, interleave, rank).tolist()
            assert got == expected
            assert [local_position(p, block_size, dcp, interleave) for p in got] == list(range(len(got)))


def test_copies_gather_every_source_before_writing_a_destination():
    layout, model = _model(layout_config())
    cache = PagedCache(layout, model.layers, model.config, num_blocks=4)
    state = cache.views[1][0]  # layer 1: the Mamba layer of slot 0
    for b in range(4):
        state[b] = b
    cache.copy_blocks([(1, 1, 2), (1, 2, 3)])  # a chain: 3 gets 2's contents from before the step
    assert [float(state[b].mean()) for b in range(4)] == [0.0, 1.0, 1.0, 2.0]


def test_groups_share_memory_per_block_id():
    # vLLM's hybrid allocator: layer 0 (attention) and layer 1 (Mamba) view the same page of a
    # block id, so a block handed to two groups at once would corrupt both.
    layout, model = _model(layout_config())
    cache = PagedCache(layout, model.layers, model.config, num_blocks=4)
    cache.views[1][0][2] = 7.0
    assert float(cache.views[0][0][2].abs().max()) == 7.0
    assert float(cache.views[0][0][1].abs().max()) == 0.0


class _Rank1Of2:
    """Rank 1 of DCP 2 without peers: the gathers return this rank's partial twice (so the
    outputs are meaningless -- position 0 has no key here -- but the writes are real)."""

    rank, size = 1, 2

    def all_gather(self, tensor):
        return [tensor, tensor]

    def broadcast_object(self, obj):
        return obj


def test_a_rank_stores_exactly_the_kv_positions_it_owns():
    layout, model = _model(layout_config(dcp=2, hash_block_size=None))
    worker = Worker(layout, model, _Rank1Of2(), num_blocks=8, max_num_reqs=2)
    tokens = tuple(range(100, 116))
    # 16 tokens: attention virtual blocks of 8 (ids 1, 2); Mamba blocks of 8 (state in id 3).
    worker.execute(WorkerStep(1, (ChunkWork("r", 0, tokens, ((1, 2), (0, 3)), True),), (), ()))
    positions = torch.arange(16)
    k = model.project(0, model.norm(model.embed(torch.tensor(tokens), positions)), "k")  # layer 0 is attention
    k_pages = worker.cache.views[0][0]  # [num_blocks, 4, H, Dh]
    # Interleave 1: rank 1 owns the odd positions; local position l of block j holds 8j + 2l + 1.
    for j, block in enumerate((1, 2)):
        for local in range(4):
            assert torch.equal(k_pages[block, local], k[8 * j + 2 * local + 1])
    assert float(k_pages[[0, 4, 5, 6, 7]].abs().max()) == 0.0  # (block 3's page holds the Mamba state)
