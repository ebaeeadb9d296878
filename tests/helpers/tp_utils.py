"""Shared setup for tensor-parallel tests: a TP=world state, seeded, and shard gathering."""

import torch
import torch.distributed as dist

from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.models.sharding import full_of
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
    """The full tensor of a tensor-parallel parameter from every rank's shard (the library's own
    ``full_of``, which honours ``partition_dim``/``partition_stride``)."""
    return full_of(shard.detach(), shard, state.tp_group)


def full_grad(param, state):
    return full_of(param.grad.detach(), param, state.tp_group)


def full_tensor(tensor, param, state):
    """The single-process tensor of ``param`` (or of a tensor shaped like it, e.g. optimizer state): expert
    shards joined over etp then gathered over ep (dim 0 counts experts), other shards joined over tp."""
    if getattr(param, "expert_parallel", False):
        return gather_along_dim(full_of(tensor.detach(), param, state.group("etp")).contiguous(), 0, state.group("ep"))
    return full_of(tensor.detach(), param, state.tp_group)
