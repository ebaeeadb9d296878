"""Column-parallel linears whose input-gradient collective runs while their weight gradient is computed.

A column-parallel linear's input gradient ``dX = dY·W`` is a partial sum over the tensor-parallel ranks: it is
reduce-scattered along the sequence (sequence parallelism: the forward all-gathered ``X``) or all-reduced (``X``
replicated). Its weight gradient ``dW = dYᵀ·X`` needs no communication. Left to autograd, ``F.linear``'s backward
computes both GEMMs and only then the gather's (or the copy's) backward starts the collective, so the GPU waits
for it. Here one autograd function does the whole layer: ``dX``, its collective launched asynchronously (NCCL runs
it on its own stream), ``dW`` while it travels, then the wait: Megatron-Core's overlap of the input-gradient
communication with the weight-gradient GEMM. The same GEMMs and the same collective as the plain path.

The local GEMMs are ``F.linear``'s, or a layer's float8 matmul when it offers them one at a time
(:class:`SplitGemms`: the float8 path with the weight cast once per step), so float8 layers overlap the same way.

The function runs eagerly under ``torch.compile`` (a graph break, like every collective of ``mappings``). Under
CUDA-graph capture the backward overlaps the same way: the asynchronous collective forks NCCL's stream from the
capturing stream and its wait joins it back before the capture ends, so the graph holds both branches.

Whether the collective really runs beside the GEMM is the GPU's business (cuBLAS's persistent kernels can take every
SM before NCCL's kernel starts): ``backward_overlap.py`` has two switches for measuring it, an SM carve-out for the
GEMM and a copy-engine reduce-scatter.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .backward_overlap import copy_engine_reduce_scatter, sm_carveout, start_copy_engine_reduce_scatter, \
    wgrad_sm_carveout
from .grad_accumulation import accumulate_weight_grad
from .mappings import eager_under_compile, gather_along_dim
from .utils import in_autocast_dtype

class SplitGemms(Protocol):
    """A layer's local matmul ``total @ weightᵀ`` whose backward runs as two GEMMs this module calls in turn: the input
    gradient's, then (after its collective started) the weight gradient's. ``saved``: the tensors ``forward_gemm``
    returned beside its output (saved for the backward)."""

    def forward_gemm(self, total: torch.Tensor, weight: torch.Tensor) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """The output (without bias) and the tensors the backward GEMMs read besides ``total`` and ``weight``."""

    def input_grad_gemm(self, grad: torch.Tensor, weight: torch.Tensor,
                        saved: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, Any]:
        """``grad @ weight`` (shaped as ``grad`` with the weight's input features), and ``grad`` as the weight
        gradient's GEMM reads it (made once for both)."""

    def grad_operand(self, grad: torch.Tensor, saved: Tuple[torch.Tensor, ...]) -> Any:
        """``grad`` as the weight gradient's GEMM reads it, when no input gradient was computed."""

    def weight_grad_gemm(self, operand: Any, total: torch.Tensor, weight: torch.Tensor,
                         saved: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``gradᵀ @ total`` in ``weight``'s dtype."""


class _ColumnParallelLinear(torch.autograd.Function):
    """``F.linear(all_gather(x) if sequence_parallel else x, weight, bias)``; backward as the module says."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, sequence_parallel: bool,
                accumulate_into: Optional[Tuple[torch.Tensor, ...]], gemms: Optional[SplitGemms]) -> torch.Tensor:
        total = gather_along_dim(x, 0, group) if sequence_parallel else x
        saved: Tuple[torch.Tensor, ...] = ()
        if gemms is None:
            out = F.linear(total, weight, bias)
        else:
            out, saved = gemms.forward_gemm(total, weight)
            out = out if bias is None else out + bias.to(out.dtype)
        ctx.save_for_backward(total, weight, *saved)
        ctx.gemms = gemms
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        # under CUDA-graph capture the collective overlaps too (NCCL's stream forks from the capturing one and is
        # joined by the wait, inside the capture); the switches for measuring stay off there, and the weight
        # gradient is returned (the capture would freeze the Python that picks its target)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        ctx.carveout = wgrad_sm_carveout() if x.is_cuda and not capturing else None
        ctx.copy_engine = x.is_cuda and not capturing and sequence_parallel and copy_engine_reduce_scatter()
        ctx.accumulate_into = None if capturing or gemms is not None else accumulate_into
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        total, weight, *saved = ctx.saved_tensors
        gemms: Optional[SplitGemms] = ctx.gemms
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x, work, pending, operand = None, None, None, None
        if ctx.needs_input_grad[0]:
            if gemms is None:
                partial = flat.mm(weight).view(*total.shape)
            else:
                partial, operand = gemms.input_grad_gemm(grad, weight, tuple(saved))
                partial = partial.view(*total.shape)
            if ctx.copy_engine:
                pending = start_copy_engine_reduce_scatter(partial, ctx.group)
            elif ctx.sequence_parallel:
                size = dist.get_world_size(ctx.group)
                grad_x = partial.new_empty((partial.shape[0] // size,) + tuple(partial.shape[1:]))
                work = dist.reduce_scatter_tensor(grad_x, partial, group=ctx.group, async_op=True)
            else:
                grad_x = partial
                work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_w = None
        with sm_carveout(ctx.carveout if work is not None or pending is not None else None):
            if ctx.accumulate_into is not None:   # into the parameters' gradients by GEMMs (grad_accumulation.py)
                first = 0
                for param in ctx.accumulate_into:   # each its rows of the weight (a strided view of grad's columns)
                    accumulate_weight_grad(param, total, grad[..., first:first + param.shape[0]])
                    first += param.shape[0]
            elif ctx.needs_input_grad[1] and gemms is not None:
                operand = gemms.grad_operand(grad, tuple(saved)) if operand is None else operand
                grad_w = gemms.weight_grad_gemm(operand, total, weight, tuple(saved))
            elif ctx.needs_input_grad[1]:
                grad_w = flat.t().mm(total.reshape(-1, total.shape[-1]))
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        if pending is not None:
            grad_x = torch.ops._c10d_functional.wait_tensor(pending)
        return grad_x, grad_w, grad_b, None, None, None, None


@eager_under_compile   # one graph break for the casts and the function (not a break inside an autocast region)
def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           group: dist.ProcessGroup, sequence_parallel: bool,
                           accumulate_into: Optional[Tuple[torch.Tensor, ...]] = None,
                           gemms: Optional[SplitGemms] = None) -> torch.Tensor:
    """A column-parallel linear's forward at tensor-parallel size > 1: ``F.linear`` (or ``gemms``) of the
    all-gathered (``sequence_parallel``) or replicated ``x``, with the backward's collective overlapped (see the
    module). ``accumulate_into``: the parameters whose rows, in order, make ``weight`` (``(the weight,)``, or the
    linears concatenated into it), each one's gradient accumulated by its own GEMM (``grad_accumulation.py``;
    ``F.linear``'s GEMMs only), or None (the gradient returned to autograd)."""
    bias = None if bias is None else in_autocast_dtype(bias, x)
    # (split GEMMs read their own operands, a float8 cast of the weight: it is not copied to the autocast dtype)
    x, weight = in_autocast_dtype(x, x), weight if gemms is not None else in_autocast_dtype(weight, x)
    with torch.autocast(x.device.type, enabled=False):
        return _ColumnParallelLinear.apply(x, weight, bias, group, sequence_parallel, accumulate_into, gemms)
