"""Shared setup for tensor-parallel tests: a TP=world state, seeded, and shard gathering."""

import torch
import torch.distributed as dist

from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.tensor_parallel.mappings import gather_along_dim

ATOL = 1e-5
RTOL = 1e-5


def tp_state(tp=None):
    world = dist.get_world_size()
    return ParallelState(ParallelLayout(world, tp=tp or world)).activate()


def gather(shard, dim, state):
    """The full tensor from every tp rank's shard along ``dim``."""
    return gather_along_dim(shard.detach(), dim, state.tp_group)


def close(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def full_param(shard, state):
    """The full tensor of a tensor-parallel parameter (or its grad) from every rank's shard.

    ``partition_stride`` > 1 (e.g. SwiGLU's gate|up) means each shard is ``stride`` blocks that
    belong to ``stride`` separate regions of the master tensor.
    """
    param = shard
    if not getattr(param, "tensor_model_parallel", False):
        return shard.detach()
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = shard.detach().chunk(stride, dim=dim)
    return torch.cat([gather_along_dim(b.contiguous(), dim, state.tp_group) for b in blocks], dim=dim)


def full_grad(param, state):
    grad = param.grad.detach()
    for name in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, name):
            setattr(grad, name, getattr(param, name))
    return full_param(grad, state)
