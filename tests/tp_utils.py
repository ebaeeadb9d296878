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
