"""Autograd-aware collectives with per-rank row counts, for moving tokens between expert ranks.

================================  ======================================  ================================
op                                forward                                 backward
================================  ======================================  ================================
``all_to_all``                    rows ``input_splits[j]`` go to rank j   the reverse all-to-all
``gather_rows``                   concatenate every rank's rows           sum the gradients of own rows
``reduce_scatter_rows``           sum partial rows, keep own rows         ``gather_rows`` of the gradient
================================  ======================================  ================================

Row counts are host integers: under dropless routing they come from one device→host copy in
the dispatcher; under pad-to-capacity they are known statically. A group of one rank (or
``None``) makes every op the identity. Ranks are positions in ``group``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..tensor_parallel.mappings import _all_gather_single


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return 0 if group is None else dist.get_rank(group)


def _a2a(x: Tensor, group: dist.ProcessGroup, output_splits: Sequence[int],
         input_splits: Sequence[int]) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, list(output_splits), list(input_splits), group=group)
    return out


def _gather_rows(x: Tensor, group: dist.ProcessGroup, sizes: Sequence[int]) -> Tensor:
    n = dist.get_world_size(group)
    return _a2a(x.repeat((n,) + (1,) * (x.dim() - 1)), group, sizes, [x.shape[0]] * n)


def _reduce_scatter_rows(x: Tensor, group: dist.ProcessGroup, sizes: Sequence[int]) -> Tensor:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    parts = _a2a(x, group, [sizes[me]] * n, sizes)
    return parts.view((n, sizes[me]) + tuple(x.shape[1:])).sum(dim=0)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _a2a(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _a2a(grad, ctx.group, input_splits, output_splits), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, ctx.sizes), None, None


def all_to_all(x: Tensor, group: Optional[dist.ProcessGroup], output_splits: List[int],
               input_splits: List[int]) -> Tensor:
    """Send ``input_splits[j]`` consecutive rows to rank j; receive ``output_splits[j]`` from it."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def gather_rows(x: Tensor, group: Optional[dist.ProcessGroup], sizes: List[int]) -> Tensor:
    """All-gather along dim 0 where rank j holds ``sizes[j]`` rows.

    Backward sums every rank's gradient of this rank's rows: the consumers (an expert's
    column-parallel shards) each produce a partial gradient.
    """
    if group_size(group) == 1:
        return x
    return _GatherRows.apply(x, group, list(sizes))


def reduce_scatter_rows(x: Tensor, group: Optional[dist.ProcessGroup], sizes: List[int]) -> Tensor:
    """Sum ``x`` (rows of every rank, ``sizes[j]`` each) over the group; keep this rank's rows."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterRows.apply(x, group, list(sizes))


def all_gather_stack(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """``[n, *x.shape]`` of every rank's ``x`` (at least 1-D), without autograd: counts, maps."""
    n = group_size(group)
    if n == 1:
        return x.unsqueeze(0)
    x = x.detach().contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out.view((n,) + tuple(x.shape))
