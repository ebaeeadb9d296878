"""ECHO's expert-weight dispatch: copy home experts into spare slots, return their gradients.

After ``gen_offloading_plan`` every EP rank knows, for each of the ``S = R·k`` spare slots in
the EP group, which home expert it runs (``-1``: unused). Slot ``j`` lives on EP rank
``j // k``; expert ``e`` lives on EP rank ``e // E_local``.

The copy is one all-to-all with *static* splits, so it needs no host sync and can be captured
in a CUDA graph: every rank sends every rank ``k`` weight blocks, one per slot of the receiver,
holding its own expert's weights where it is the slot's home rank and zeros elsewhere; the
receiver sums the ``R`` blocks of each slot (one non-zero block plus zeros is exact). The
price of static shapes is ``R·k`` blocks sent per rank where ``k`` carry data.

Autograd does the gradient return: the all-to-all's backward sends each slot's weight
gradient back to every rank, the mask keeps it only on the home rank, and ``index_select``'s
backward adds it into the home expert's gradient, next to the gradient of the tokens the home
expert computed itself. Expert tensor parallelism needs nothing extra: the exchange runs inside
one etp slice (the ep group), so slot copies carry the same slice as their home.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import all_to_all, group_rank, group_size


def dispatch_to_spare_slots(weight: Tensor, spare_homes: Tensor, group: Optional[dist.ProcessGroup],
                            num_spare_experts_per_ep_rank: int) -> Tensor:
    """Weights of this rank's ``k`` spare slots, gathered from their home experts' ranks.

    Args:
        weight: ``[E_local, ...]`` this rank's home experts (a parameter; gradients flow back).
        spare_homes: ``[R·k]`` int64 global home expert of every spare slot of the EP group,
            in slot order, ``-1`` for unused slots; identical on every EP rank.
        group: the expert-parallel group (``None``: a single EP rank).
        num_spare_experts_per_ep_rank: ``k``.

    Returns:
        ``[k, ...]``: slot ``s`` of this rank holds its home expert's weights (zeros if unused).
    """
    num_ranks, rank, k = group_size(group), group_rank(group), num_spare_experts_per_ep_rank
    num_local = weight.shape[0]
    if spare_homes.shape != (num_ranks * k,):
        raise ValueError(f"spare_homes must have num_ep_ranks * num_spare_experts_per_ep_rank = {num_ranks * k} "
                         f"entries, got shape {tuple(spare_homes.shape)}.")
    homes = spare_homes.to(device=weight.device, dtype=torch.long)
    mine = (homes >= 0) & (homes.clamp(min=0) // num_local == rank)           # [S] this rank is the home
    local_index = homes.clamp(min=0) % num_local
    mask = mine.view((-1,) + (1,) * (weight.dim() - 1))
    blocks = torch.where(mask, weight.index_select(0, local_index), weight.new_zeros(()))   # [S, ...]
    splits = [k] * num_ranks                                                 # k blocks to/from every rank
    received = all_to_all(blocks, group, splits, splits)                     # [R (source), k, ...] flattened
    return received.view((num_ranks, k) + tuple(weight.shape[1:])).sum(dim=0)
