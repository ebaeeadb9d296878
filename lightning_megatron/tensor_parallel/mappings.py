"""Autograd-aware collectives over the tensor-parallel group (seed 002, section 3).

Each op is a pair (forward collective, backward collective) that are conjugates, so the
gradient of a parallel region is exactly the gradient of the single-process computation:

========================================  ====================  ========================
op                                        forward               backward
========================================  ====================  ========================
``copy_to_tensor_parallel_region`` (f)    identity              all-reduce
``reduce_from_tensor_parallel_region`` (g) all-reduce           identity
``scatter_to_tensor_parallel_region``     split last dim        all-gather last dim
``gather_from_tensor_parallel_region``    all-gather last dim   split last dim
``scatter_to_sequence_parallel_region``   split first dim       all-gather first dim
``gather_from_sequence_parallel_region``  all-gather first dim  reduce-scatter first dim
                                                                (or split, see below)
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter   all-gather first dim
========================================  ====================  ========================

Every op takes an optional explicit ``group``; by default the active ``ParallelState``'s tp
group. A group of one rank makes every op the identity.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..parallel import get_parallel_state

# torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``group`` itself, or the active state's tensor-parallel group."""
    return group if group is not None else get_parallel_state().tp_group


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(resolve_group(group))


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(resolve_group(group))


# -- raw collectives (no autograd) ------------------------------------------------------------------

# torch.compile does not trace the collectives: each one is a graph break (``torch._dynamo.disable``) and runs
# eagerly, its autograd function too, so compiled layers fuse what lies between collectives and communicate exactly
# as eager layers do. Traced, they were wrong on GPUs (issue #32): torch 2.11's remap of the in-place c10d calls gave
# the first layer's input a wrong gradient at tensor-parallel size 2 (NCCL and gloo alike), and c10d's functional
# collectives did too with sequence parallelism; torch 2.13 traced both exactly. The disabled copies are made on first
# need (importing torch._dynamo costs ~0.8 s, which a program that never compiles must not pay); eager calls pay one
# ``is_compiling`` check.
_EAGER: List[Callable[..., Any]] = []
_DISABLED: Dict[Callable[..., Any], Callable[..., Any]] = {}


def _disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    found = _DISABLED.get(fn)
    if found is None:   # reached under tracing, this call is itself a graph break: correct, only slower to trace
        import torch._dynamo

        found = _DISABLED[fn] = torch._dynamo.disable(fn)
    return found


def prepare_for_compile() -> None:
    """Make every collective's disabled copy now (``compile_layers`` calls it), so tracing meets only their breaks."""
    for fn in _EAGER:
        _disabled(fn)


def eager_under_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as it is when eager, a graph break running it eagerly under ``torch.compile`` (see above)."""
    _EAGER.append(fn)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args)
        return fn(*args)
    return call


_eager = eager_under_compile


@_eager
def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def split_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.shape[dim]} over {size} tensor-parallel ranks; "
            f"it must be divisible by {size}."
        )
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


@_eager
def gather_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


@_eager
def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(
            f"sequence-parallel reduce-scatter needs the first (sequence) dimension {x.shape[0]} "
            f"to be divisible by the tensor-parallel size {size}."
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


# -- autograd functions -----------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, -1, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, -1, ctx.group), None


class _ScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 0, ctx.group), None


class _GatherFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group = group
        ctx.grad_is_partial = grad_is_partial
        return gather_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter_first_dim(grad, ctx.group), None, None
        return split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 0, ctx.group), None


# -- public ops -------------------------------------------------------------------------------------


@_eager
def _eager_apply(function, *args):
    return function.apply(*args)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The paper's f: identity forward, all-reduce of the gradient backward."""
    group = resolve_group(group)
    return x if dist.get_world_size(group) == 1 else _eager_apply(_CopyToRegion, x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The paper's g: all-reduce forward, identity backward."""
    group = resolve_group(group)
    return x if dist.get_world_size(group) == 1 else _eager_apply(_ReduceFromRegion, x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the gradient is all-gathered back."""
    group = resolve_group(group)
    return x if dist.get_world_size(group) == 1 else _eager_apply(_ScatterLastDim, x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather along the last dimension; the gradient is split back."""
    group = resolve_group(group)
    return x if dist.get_world_size(group) == 1 else _eager_apply(_GatherLastDim, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's slice of the first (sequence) dimension; the gradient is all-gathered."""
    group = resolve_group(group)
    return x if dist.get_world_size(group) == 1 else _eager_apply(_ScatterFirstDim, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather along the first (sequence) dimension.

    When the consumer is tensor-parallel (a column-parallel linear), each rank's gradient is a
    partial sum over its output columns, so backward reduce-scatters it; when the consumer is
    replicated (``tensor_parallel_output_grad=False``), backward just keeps this rank's slice.
    """
    group = resolve_group(group)
    if dist.get_world_size(group) == 1:
        return x
    return _eager_apply(_GatherFirstDim, x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum partial results over the group and keep this rank's sequence slice; backward all-gathers."""
    group = resolve_group(group)
    return x if dist.get_world_size(group) == 1 else _eager_apply(_ReduceScatterFirstDim, x, group)
