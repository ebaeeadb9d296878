"""What every rank must agree on before the first step (seeds, replicated parameters), and the dataset order of
data-parallel predictions."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch import nn

from ..parallel import ParallelState
from ..tensor_parallel.random import get_rng_tracker, seed_tracker


def seed_identically(state: ParallelState, device: torch.device) -> int:
    """One seed for the world (rank 0's), so replicated activations draw identical dropout on every tp rank;
    the tracker's tp/ep streams are derived from it. Returns the seed."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.long, device=device)
    dist.broadcast(seed, src=0)   # on the device NCCL needs, and read back from that same tensor
    value = int(seed.item())
    torch.manual_seed(value)
    seed_tracker(get_rng_tracker(state), value, state.tp_rank, state.ep_rank, state.etp_rank)
    return value


@torch.no_grad()
def make_replicas_identical(model: nn.Module, state: ParallelState) -> None:
    """Copies of one parameter must start equal: broadcast from the first rank of each group that holds copies
    (dp·cp for dense parameters, edp for experts, and tp for what tensor parallelism replicates)."""
    for param in list(model.parameters()) + list(model.buffers()):
        expert = getattr(param, "expert_parallel", False)
        name = "edp" if expert else "dp-cp"
        if state.size(name) > 1:
            dist.broadcast(param.data, src=state.ranks(name)[0], group=state.group(name))
        if not expert and not getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
            dist.broadcast(param.data, src=state.ranks("tp")[0], group=state.tp_group)


def in_dataset_order(batches: List[Any], state: ParallelState, total: int) -> Optional[List[Any]]:
    """Per-batch predictions of every data-parallel rank, interleaved back into dataset order (a collective
    over dp). A distributed sampler gives rank r the samples r, r+dp, r+2dp, ... (padded by repeating the
    first ones). Outputs nest dicts, tuples and lists whose leaves are tensors with the batch as their first
    dimension (the same on every rank); anything else (strings, a list per sample) gives ``None``: it cannot
    be put in order (the decision is this rank's: every rank's outputs have the same structure)."""
    if state.dp_size == 1 or not batches:
        return batches
    flat = [tree_flatten(b) for b in batches]
    spec = flat[0][1]
    ordered_leaves = all(
        s == spec and leaves and all(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == leaves[0].shape[0]
                                     for t in leaves)
        for leaves, s in flat)
    if not ordered_leaves:
        return None
    columns = [_column_in_order([leaves[i] for leaves, _ in flat], state, total) for i in range(len(flat[0][0]))]
    return [tree_unflatten([column[j] for column in columns], spec) for j in range(len(columns[0]))]


def _column_in_order(tensors: List[torch.Tensor], state: ParallelState, total: int) -> List[torch.Tensor]:
    local = torch.cat([t.cpu() for t in tensors])
    gathered: List[Any] = [None] * state.dp_size
    dist.all_gather_object(gathered, local, group=state.dp_group)
    ordered = torch.stack(gathered, dim=1).flatten(0, 1)[:total]
    return list(ordered.split(tensors[0].shape[0] * state.dp_size))
