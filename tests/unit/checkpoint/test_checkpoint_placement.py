"""Pieces of a local shard are exactly the boxes of the global tensor it holds (pure, one process)."""

import pytest
import torch

from lightning_megatron.checkpoint.placement import Ranks, placement_of
from lightning_megatron.models.sharding import shard_of


def _param(shape, dim=None, stride=1, **attrs):
    p = torch.nn.Parameter(torch.zeros(shape))
    if dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _tiles(full, make_local, ranks_list, param):
    """Check every piece against ``full`` and that the pieces of all ranks tile it exactly once."""
    covered = torch.zeros(full.shape, dtype=torch.int64)
    for ranks, first_expert in ranks_list:
        local = make_local(ranks, first_expert)
        placement = placement_of(_like(param, local), ranks, first_expert)
        assert placement.global_shape == tuple(full.shape)
        for piece in placement.pieces:
            assert torch.equal(piece.view(local), piece.of_global(full))
            piece.of_global(covered).add_(1)
    assert torch.equal(covered, torch.ones_like(covered))


def _like(param, local):
    p = torch.nn.Parameter(local.clone())
    for k in ("tensor_model_parallel", "partition_dim", "partition_stride", "expert_parallel", "vocab_size"):
        if hasattr(param, k):
            setattr(p, k, getattr(param, k))
    return p


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dim, stride", [(0, 1), (1, 1), (0, 2)])   # (0, 2): SwiGLU fc1 weight/bias
def test_tensor_parallel_shards_tile_the_global_tensor(tp, dim, stride):
    full = torch.randn(16, 8)
    param = _param(full.shape, dim, stride)
    ranks = [(Ranks(tp_rank=r, tp_size=tp), None) for r in range(tp)]
    _tiles(full, lambda rk, _: shard_of(full, param, rk.tp_rank, rk.tp_size), ranks, param)


def test_swiglu_shard_is_two_blocks_of_the_global_gate_and_up():
    full = torch.arange(16.0)                   # [gate 0..7 | up 8..15]
    param = _param((8,), 0, 2)
    placement = placement_of(_like(param, shard_of(full, param, 1, 2)), Ranks(tp_rank=1, tp_size=2))
    assert [(p.local_offsets, p.global_offsets, p.sizes) for p in placement.pieces] == \
        [((0,), (4,), (4,)), ((4,), (12,), (4,))]


def test_vocabulary_padding_is_left_out():
    vocab, padded, tp = 100, 256, 2            # 128 rows per rank: rank 1 holds 28 real rows
    real = torch.randn(vocab, 4)
    full = torch.cat([real, torch.zeros(padded - vocab, 4)])
    param = _param(full.shape, 0, 1, vocab_size=vocab)
    ranks = [(Ranks(tp_rank=r, tp_size=tp), None) for r in range(tp)]
    _tiles(real, lambda rk, _: shard_of(full, param, rk.tp_rank, rk.tp_size), ranks, param)
    only_padding = placement_of(_like(param, torch.zeros(128, 4)), Ranks(tp_rank=3, tp_size=4))
    assert only_padding.pieces == () and only_padding.global_shape == (vocab, 4)


@pytest.mark.parametrize("ep, etp", [(2, 1), (2, 2), (4, 1)])
def test_expert_shards_map_to_global_expert_indices(ep, etp):
    experts, n = 4, 2                            # SwiGLU expert weight1 [E, 2·F, H], split over etp with stride 2
    full = torch.randn(experts, 2 * 4, 3)
    param = _param((experts // ep, 2 * 4 // etp, 3), 1 if etp > 1 else None, n, expert_parallel=True)
    local_experts = experts // ep

    def local(rk, first):
        mine = full[first:first + local_experts]
        return torch.stack([shard_of(e, _param(e.shape, 0, n), rk.etp_rank, rk.etp_size) for e in mine])
    ranks = [(Ranks(etp_rank=t, etp_size=etp, ep_rank=e, ep_size=ep), e * local_experts)
             for e in range(ep) for t in range(etp)]
    _tiles(full, local, ranks, param)
