"""Sequence-parallel linears whose communication overlaps their GEMMs (``tp_comm_overlap=True``).

With sequence parallelism a column-parallel linear all-gathers its input along the sequence before its GEMM and
a row-parallel one reduce-scatters its output after it: the GPU waits for each collective. Here both go round a
ring of the tensor-parallel ranks, one sequence chunk per step: while one chunk travels to the next rank, the
GEMM of the chunk at hand runs (the collective-matmul decomposition that Megatron-Core's userbuffer overlap and
PyTorch's async TP use), with NCCL's send/receive on its own stream and the GEMM on the compute stream.

Backward does the same for the input gradient (reduce-scatter after a column linear, all-gather before a row
linear's) and collects the other operand of the weight gradient into one buffer as it passes, so the weight
gradient stays one GEMM over the whole sequence. The column linear keeps only its own sequence chunk of the input
between forward and backward (the plain path keeps the gathered input): less activation memory.

On CUDA, where PyTorch's symmetric memory is available, the same decomposition runs through its fused ops
(``_fused_all_gather_matmul`` / ``_fused_matmul_reduce_scatter``: the chunks move by copy engine between the GPUs'
symmetric buffers, so no SMs are taken from the GEMMs; multicast stays off); the column linear then keeps the
gathered input for its weight gradient, as the plain path does. ``LIGHTNING_MEGATRON_TP_OVERLAP=ring`` keeps the
NCCL send/receive ring there too (the CPU and gloo always use it).

Partial sums are added in ring order rather than NCCL's: equal to the plain path to float rounding. The
functions run eagerly under ``torch.compile`` (each is a graph break, like every collective of ``mappings``).
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .mappings import _eager_apply
from .utils import in_autocast_dtype

BACKEND_ENV = "LIGHTNING_MEGATRON_TP_OVERLAP"   # "auto" (default): symmetric memory on CUDA; "ring": NCCL ring
_GATHER_TAG, _REDUCE_TAG = 71, 72   # gloo matches messages by tag; NCCL keeps issue order (and ignores tags)


def _ring(group: dist.ProcessGroup) -> Tuple[int, int, int, int]:
    """(size, this rank in the group, global rank of the next, global rank of the previous)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return (size, rank, dist.get_global_rank(group, (rank + 1) % size),
            dist.get_global_rank(group, (rank - 1) % size))


def _pass_on(send: torch.Tensor, recv: torch.Tensor, ring: Tuple[int, int, int, int], group: dist.ProcessGroup,
             tag: int) -> List[dist.Work]:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one, asynchronously."""
    _, _, nxt, prv = ring
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group, tag),
                                   dist.P2POp(dist.irecv, recv, prv, group, tag)]) or []


def _wait(works: List[dist.Work]) -> None:
    for work in works:
        work.wait()


def _chunk(x: torch.Tensor, index: int, size: int) -> torch.Tensor:
    n = x.shape[0] // size
    return x[index * n:(index + 1) * n]


def _all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       group: dist.ProcessGroup) -> torch.Tensor:
    """``F.linear(all_gather(x, dim 0), weight, bias)``, the chunk at hand multiplied while the next travels."""
    ring = _ring(group)
    size, rank = ring[0], ring[1]
    out: Optional[torch.Tensor] = None
    current = x.contiguous()
    for step in range(size):
        works, arriving = [], None
        if step < size - 1:
            arriving = torch.empty_like(current)
            works = _pass_on(current, arriving, ring, group, _GATHER_TAG)
        part = F.linear(current, weight, bias)
        if out is None:
            out = part.new_empty((x.shape[0] * size,) + tuple(part.shape[1:]))
        _chunk(out, (rank - step) % size, size).copy_(part)
        _wait(works)
        if arriving is not None:
            current = arriving
    assert out is not None
    return out


def _matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup,
                           gather: Optional[torch.Tensor] = None,
                           gathered: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's sequence chunk of ``sum over ranks of x @ weight`` (``x``: every rank's partial product input
    over the whole sequence; ``weight`` as in ``x @ weight``). Each step multiplies the chunk that the accumulator
    arriving next belongs to. With ``gather`` (this rank's chunk of a tensor) it also all-gathers that along the
    same ring into ``gathered``."""
    ring = _ring(group)
    size, rank = ring[0], ring[1]
    x = x.contiguous()
    if gather is not None:
        assert gathered is not None
        _chunk(gathered, rank, size).copy_(gather)
    partial: Optional[torch.Tensor] = None
    pending: List[dist.Work] = []
    arriving: Optional[torch.Tensor] = None
    sent: List[torch.Tensor] = []   # alive until their sends complete
    for step in range(size):
        gather_works: List[dist.Work] = []
        if gather is not None and step < size - 1:
            assert gathered is not None
            gather_works = _pass_on(_chunk(gathered, (rank - step) % size, size),
                                    _chunk(gathered, (rank - step - 1) % size, size), ring, group, _GATHER_TAG)
        partial = _chunk(x, (rank - step - 1) % size, size) @ weight
        if step > 0:
            _wait(pending)
            assert arriving is not None
            partial += arriving
        if step < size - 1:
            arriving = torch.empty_like(partial)
            sent.append(partial)
            pending = _pass_on(partial, arriving, ring, group, _REDUCE_TAG)
        _wait(gather_works)
    assert partial is not None
    return partial


def _sum_rows(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _AllGatherLinear(torch.autograd.Function):
    """Column-parallel linear under sequence parallelism: ``F.linear(all_gather(x), weight, bias)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return _all_gather_matmul(x, weight, bias, group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        gathered = x.new_empty((x.shape[0] * size,) + tuple(x.shape[1:]))
        grad_x = _matmul_reduce_scatter(grad, weight, ctx.group, gather=x, gathered=gathered)
        grad_w = _weight_grad(grad, gathered)
        return grad_x, grad_w, _sum_rows(grad) if ctx.has_bias else None, None


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel linear under sequence parallelism: ``reduce_scatter(F.linear(x, weight))`` (no bias)."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return _matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ring = _ring(ctx.group)
        size, rank = ring[0], ring[1]
        grad = grad.contiguous()
        gathered = grad.new_empty((grad.shape[0] * size,) + tuple(grad.shape[1:]))
        grad_x = x.new_empty(x.shape[:-1] + (weight.shape[1],), dtype=grad.dtype)
        current = grad
        for step in range(size):
            works, arriving = [], None
            if step < size - 1:
                arriving = torch.empty_like(current)
                works = _pass_on(current, arriving, ring, ctx.group, _GATHER_TAG)
            source = (rank - step) % size
            _chunk(gathered, source, size).copy_(current)
            torch.matmul(current, weight, out=_chunk(grad_x, source, size))
            _wait(works)
            if arriving is not None:
                current = arriving
        return grad_x, _weight_grad(gathered, x), None


def _symmetric_memory(x: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """PyTorch's symmetric-memory module with ``group`` enabled, when ``x`` is on CUDA and it is there; else None."""
    if x.device.type != "cuda" or os.environ.get(BACKEND_ENV, "auto") == "ring":
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    if not hasattr(symm_mem, "_fused_all_gather_matmul"):
        return None
    return enable_symmetric_memory(group)


def enable_symmetric_memory(group: dist.ProcessGroup) -> Any:
    """PyTorch's symmetric-memory module, with ``group`` enabled for it (once)."""
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    return symm_mem


class _SymmetricAllGatherLinear(torch.autograd.Function):
    """``_AllGatherLinear`` through symmetric memory's fused ops."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, symm_mem):
        ctx.group, ctx.symm_mem, ctx.has_bias = group, symm_mem, bias is not None
        gathered, (out,) = symm_mem._fused_all_gather_matmul(x.contiguous(), [weight.t()], 0, group.group_name,
                                                             return_A=True)
        ctx.save_for_backward(gathered, weight)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = ctx.symm_mem._fused_matmul_reduce_scatter(grad, weight, "sum", 0, ctx.group.group_name)
        return grad_x, _weight_grad(grad, gathered), _sum_rows(grad) if ctx.has_bias else None, None, None


class _SymmetricLinearReduceScatter(torch.autograd.Function):
    """``_LinearReduceScatter`` through symmetric memory's fused ops."""

    @staticmethod
    def forward(ctx, x, weight, group, symm_mem):
        ctx.group, ctx.symm_mem = group, symm_mem
        ctx.save_for_backward(x, weight)
        return symm_mem._fused_matmul_reduce_scatter(x.contiguous(), weight.t(), "sum", 0, group.group_name)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered, (grad_x,) = ctx.symm_mem._fused_all_gather_matmul(grad.contiguous(), [weight], 0,
                                                                    ctx.group.group_name, return_A=True)
        return grad_x, _weight_grad(gathered, x), None, None


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      group: dist.ProcessGroup) -> torch.Tensor:
    """``F.linear(gather_from_sequence_parallel_region(x), weight, bias)`` with the gather overlapped."""
    if dist.get_world_size(group) == 1:
        return F.linear(x, weight, bias)
    bias = None if bias is None else in_autocast_dtype(bias, x)
    x, weight = in_autocast_dtype(x, x), in_autocast_dtype(weight, x)
    symm_mem = _symmetric_memory(x, group)
    with torch.autocast(x.device.type, enabled=False):
        if symm_mem is not None:
            return _eager_apply(_SymmetricAllGatherLinear, x, weight, bias, group, symm_mem)
        return _eager_apply(_AllGatherLinear, x, weight, bias, group)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``reduce_scatter_to_sequence_parallel_region(F.linear(x, weight))`` with the reduce-scatter overlapped."""
    if dist.get_world_size(group) == 1:
        return F.linear(x, weight)
    if x.shape[0] % dist.get_world_size(group):
        raise ValueError(f"tp_comm_overlap: the sequence dimension {x.shape[0]} must be divisible by the "
                         f"tensor-parallel size {dist.get_world_size(group)}.")
    x, weight = in_autocast_dtype(x, x), in_autocast_dtype(weight, x)
    symm_mem = _symmetric_memory(x, group)
    with torch.autocast(x.device.type, enabled=False):
        if symm_mem is not None:
            return _eager_apply(_SymmetricLinearReduceScatter, x, weight, group, symm_mem)
        return _eager_apply(_LinearReduceScatter, x, weight, group)
