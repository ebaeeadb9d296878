"""Column-parallel linears whose input-gradient collective runs while their weight gradient is computed.

A column-parallel linear's input gradient ``dX = dY·W`` is a partial sum over the tensor-parallel ranks: it is
reduce-scattered along the sequence (sequence parallelism: the forward all-gathered ``X``) or all-reduced (``X``
replicated). Its weight gradient ``dW = dYᵀ·X`` needs no communication. Left to autograd, ``F.linear``'s backward
computes both GEMMs and only then the gather's (or the copy's) backward starts the collective, so the GPU waits
for it. Here one autograd function does the whole layer: ``dX``, its collective launched asynchronously (NCCL runs
it on its own stream), ``dW`` while it travels, then the wait: Megatron-Core's overlap of the input-gradient
communication with the weight-gradient GEMM. The same GEMMs and the same collective as the plain path.

Several column-parallel linears reading one input (grouped-query attention's q and kv) run as one function: one
gather, the input gradient's shares summed by their GEMMs, one collective overlapping all their weight gradients.

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

from typing import Any, List, Optional, Protocol, Sequence, Tuple, cast

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
    """``F.linear(total, weight_i, bias_i)`` for each weight, ``total`` = ``all_gather(x)`` if ``sequence_parallel``
    else ``x`` (one gathered input for all of them); backward as the module says, the input gradient summed over the
    weights before its one collective."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool,
                accumulate_into: Optional[Tuple[Optional[torch.Tensor], ...]], gemms: Optional[SplitGemms],
                count: int, *weights_and_biases: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        weights = cast(Tuple[torch.Tensor, ...], weights_and_biases[:count])   # (tensors: the wrapper's)
        biases = weights_and_biases[count:]
        total = gather_along_dim(x, 0, group) if sequence_parallel else x
        saved: Tuple[torch.Tensor, ...] = ()
        if gemms is None:
            outs = tuple(F.linear(total, w, b) for w, b in zip(weights, biases))
        else:   # (one weight)
            out, saved = gemms.forward_gemm(total, weights[0])
            outs = (out if biases[0] is None else out + biases[0].to(out.dtype),)
        ctx.save_for_backward(total, *weights, *saved)
        ctx.gemms, ctx.count = gemms, count
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.has_bias = tuple(b is not None for b in biases)
        # under CUDA-graph capture the collective overlaps too (NCCL's stream forks from the capturing one and is
        # joined by the wait, inside the capture); the switches for measuring stay off there, and the weight
        # gradients are returned (the capture would freeze the Python that picks their targets)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        ctx.carveout = wgrad_sm_carveout() if x.is_cuda and not capturing else None
        ctx.copy_engine = x.is_cuda and not capturing and sequence_parallel and copy_engine_reduce_scatter()
        ctx.accumulate_into = None if capturing or gemms is not None else accumulate_into
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        count = ctx.count
        total, *rest = ctx.saved_tensors
        weights, saved = rest[:count], tuple(rest[count:])
        gemms: Optional[SplitGemms] = ctx.gemms
        flats = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_x, work, pending, operand = None, None, None, None
        if ctx.needs_input_grad[0]:
            if gemms is None:
                partial = flats[0].mm(weights[0])
                for flat, weight in zip(flats[1:], weights[1:]):   # the weights' shares, summed by their GEMMs
                    partial.addmm_(flat, weight)
                partial = partial.view(*total.shape)
            else:
                partial, operand = gemms.input_grad_gemm(grads[0], weights[0], saved)
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
        weight_grads: List[Optional[torch.Tensor]] = [None] * count
        total_2d = total.reshape(-1, total.shape[-1])
        with sm_carveout(ctx.carveout if work is not None or pending is not None else None):
            for i, (grad, weight) in enumerate(zip(grads, weights)):
                into = None if ctx.accumulate_into is None else ctx.accumulate_into[i]
                if into is not None:   # into the parameter's gradient by the GEMM (grad_accumulation.py)
                    accumulate_weight_grad(into, total, grad)
                elif ctx.needs_input_grad[6 + i] and gemms is not None:
                    operand = gemms.grad_operand(grad, saved) if operand is None else operand
                    weight_grads[i] = gemms.weight_grad_gemm(operand, total, weight, saved)
                elif ctx.needs_input_grad[6 + i]:
                    weight_grads[i] = flats[i].t().mm(total_2d)
        bias_grads = [flat.sum(0) if has and ctx.needs_input_grad[6 + count + i] else None
                      for i, (flat, has) in enumerate(zip(flats, ctx.has_bias))]
        if work is not None:
            work.wait()
        if pending is not None:
            grad_x = torch.ops._c10d_functional.wait_tensor(pending)
        return (grad_x, None, None, None, None, None, *weight_grads, *bias_grads)


@eager_under_compile   # one graph break for the casts and the function (not a break inside an autocast region)
def column_parallel_linears(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                            group: dist.ProcessGroup, sequence_parallel: bool,
                            accumulate_into: Optional[Sequence[Optional[torch.Tensor]]] = None,
                            gemms: Optional[SplitGemms] = None) -> Tuple[torch.Tensor, ...]:
    """Column-parallel linears' forwards at tensor-parallel size > 1 on one input: ``F.linear`` (or ``gemms``, one
    weight) of the all-gathered (``sequence_parallel``) or replicated ``x`` with each weight and bias, with the
    backward's one collective overlapped (see the module). ``accumulate_into``: per weight, the parameter whose
    gradient the backward's GEMM accumulates (``grad_accumulation.py``; ``F.linear``'s GEMMs only), or None for a
    gradient returned to autograd (all None: ``accumulate_into=None``)."""
    if len(weights) != len(biases) or (gemms is not None and len(weights) != 1):
        raise ValueError(f"column_parallel_linears takes a bias (or None) per weight, and split GEMMs for one weight: "
                         f"{len(weights)} weights, {len(biases)} biases, gemms={gemms is not None}.")
    biases = tuple(None if b is None else in_autocast_dtype(b, x) for b in biases)
    # (split GEMMs read their own operands, a float8 cast of the weight: it is not copied to the autocast dtype)
    weights = tuple(weights) if gemms is not None else tuple(in_autocast_dtype(w, x) for w in weights)
    x = in_autocast_dtype(x, x)
    into = None if accumulate_into is None or all(p is None for p in accumulate_into) else tuple(accumulate_into)
    with torch.autocast(x.device.type, enabled=False):
        return _ColumnParallelLinear.apply(x, group, sequence_parallel, into, gemms, len(weights), *weights, *biases)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           group: dist.ProcessGroup, sequence_parallel: bool,
                           accumulate_into: Optional[Tuple[torch.Tensor]] = None,
                           gemms: Optional[SplitGemms] = None) -> torch.Tensor:
    """:func:`column_parallel_linears` with one weight: ``accumulate_into`` ``(the weight parameter,)`` or None."""
    return column_parallel_linears(x, (weight,), (bias,), group, sequence_parallel, accumulate_into, gemms)[0]
