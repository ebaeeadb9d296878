"""Autograd-aware collectives over the context-parallel group, and the loss reduction over it.

Gradient convention: every parameter is replicated over cp, and each cp rank backpropagates its
SHARE of the objective, so the SUM of the cp ranks' gradients is the gradient of the whole
sequence. Token losses: :func:`context_parallel_loss_mean` (this rank's loss sum over the global
token count). A loss every cp rank computes identically (e.g. on BERT's pooled ``[CLS]`` state)
contributes its share when divided by ``cp_size``. A data-parallel reduction that AVERAGES over
the dp-cp group (divides by dp·cp) must therefore scale by cp: multiply the loss by ``cp_size``
before backward (as Megatron-LM does), or sum over cp and average over dp only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..parallel import get_parallel_state
from ..tensor_parallel.mappings import all_reduce, gather_along_dim, reduce_scatter_first_dim
from .split import reorder_to_ranks, reorder_to_sequence


def _cp_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else get_parallel_state().cp_group


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather every rank's slice and put the chunks in sequence order.
    Backward: the inverse reorder, then reduce-scatter (each rank's slice was used by every rank)."""

    @staticmethod
    def forward(ctx, x, seq_dim, group):
        ctx.seq_dim, ctx.group = seq_dim, group
        cp = dist.get_world_size(group)
        return reorder_to_sequence(gather_along_dim(x, seq_dim, group), cp, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        cp = dist.get_world_size(ctx.group)
        ranked = reorder_to_ranks(grad, cp, ctx.seq_dim).movedim(ctx.seq_dim, 0)
        return reduce_scatter_first_dim(ranked, ctx.group).movedim(0, ctx.seq_dim), None, None


def all_gather_context_parallel(x: torch.Tensor, seq_dim: int = 1,
                                group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The whole sequence, in order, from every cp rank's load-balanced slice (differentiable).

    ``group``: default the active ``ParallelState``'s cp group; a group of one returns ``x``.
    """
    group = _cp_group(group)
    if dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, seq_dim % x.dim(), group)


class _BroadcastFromFirst(torch.autograd.Function):
    """Forward: rank 0's tensor on every rank. Backward: rank 0 receives the sum of all ranks'
    gradients (every rank's loss used it), the other ranks none."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.detach().clone().contiguous()
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        total = all_reduce(grad.clone(), ctx.group)
        return (total if dist.get_rank(ctx.group) == 0 else torch.zeros_like(total)), None


def context_parallel_first_token(hidden: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``hidden[:, 0]`` of the whole sequence (``[b, s_local, ...]`` → ``[b, ...]``) on every cp rank.

    Global position 0 lives on cp rank 0 (its first chunk); e.g. BERT's pooler reads ``[CLS]`` there.
    """
    group = _cp_group(group)
    first = hidden[:, 0]
    if dist.get_world_size(group) == 1:
        return first
    return _BroadcastFromFirst.apply(first, group)


def context_parallel_loss_mean(per_token_loss: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Mean of the per-token loss over every token of the sequence (all cp ranks), masked by ``loss_mask``.

    The value is the global mean on every cp rank (what to log); its gradient is this rank's share,
    ``sum(loss·mask) / global_count``, so the sum over cp of the ranks' gradients is the gradient of
    the global mean. The count and the value are all-reduced over cp (two scalars, no gradient).
    With ``cp == 1`` this is the plain masked mean.
    """
    group = _cp_group(group)
    loss = per_token_loss.float()
    mask = torch.ones_like(loss) if loss_mask is None else loss_mask.to(loss.dtype)
    if mask.shape != loss.shape:
        raise ValueError(f"loss_mask {tuple(mask.shape)} must have the shape of per_token_loss {tuple(loss.shape)}.")
    local_sum = (loss * mask).sum()
    count = all_reduce(mask.sum().detach().clone(), group).clamp(min=1.0)
    share = local_sum / count
    if dist.get_world_size(group) == 1:
        return share
    total = all_reduce(share.detach().clone(), group)
    return share + (total - share.detach())
