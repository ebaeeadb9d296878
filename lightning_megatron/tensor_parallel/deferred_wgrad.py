"""Backward split for the zero-bubble schedule: input gradients now, weight gradients later (``W``).

A zero-bubble pipeline sends a micro-batch's input gradient upstream as soon as it exists and runs the
weight-gradient GEMMs where the stage would otherwise wait (``pipeline/zero_bubble.py``). Here is the
split, for the column- and row-parallel linears (the bulk of a layer's weight FLOPs):

- ``enable_deferred_weight_grads(module)`` marks a model's linears (idempotent; the executor does it for
  the zero-bubble schedule). A marked linear behaves as before except inside ``collect_weight_grads``.
- A forward run inside ``collect_weight_grads(queue)`` binds each marked linear to ``queue``; its backward
  then computes the input (and bias) gradient only and leaves ``(weight, input, output gradient)`` in it.
- ``queue.run()`` (the ``W`` step) computes each ``dW = grad_outputᵀ · input`` as autograd would and
  hands it to autograd as the weight's gradient: it lands in ``.grad`` (or ``main_grad``, through the
  buffers' hooks) and fires the same post-accumulate hooks, so overlapped data-parallel reduction starts
  when the weight's last ``W`` runs, not at its ``B``.

Deferred: the weights of ``ColumnParallelLinear`` / ``RowParallelLinear`` called with their own weight.
Not deferred (computed in ``B`` as usual): biases, norms, embeddings, the output layer, expert weights
indexed per expert, a weight all-gathered before use (grouped-query kv shared over tp), anything under
activation recomputation (its forward runs again inside ``B``, outside any queue) and float8 matmuls.

Memory: each deferred linear keeps its input and its output gradient from ``B`` until ``W`` (the input
is what its backward saved anyway; under sequence parallelism that is the all-gathered input). Under
``torch.compile`` a marked linear is a graph break (its queue is Python state), as the collectives are.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import eager_under_compile
from .utils import in_autocast_dtype


class WeightGradQueue:
    """The weight-gradient work one micro-batch's input-gradient backward left for its ``W`` step."""

    def __init__(self) -> None:
        self._work: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (weight, input, grad_output)

    def __len__(self) -> int:
        return len(self._work)

    def add(self, weight: torch.Tensor, inp: torch.Tensor, grad_output: torch.Tensor) -> None:
        self._work.append((weight, inp, grad_output))

    def run(self) -> None:
        """Compute every deferred weight gradient and accumulate it through autograd (``.grad`` / hooks), in
        the order the backward produced them; a weight used twice gets its contributions summed first."""
        work, self._work = self._work, []
        summed: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, inp, grad_output in work:
            dw = weight_grad(inp, grad_output)
            if id(weight) in summed:
                dw = summed[id(weight)][1] + dw
            summed[id(weight)] = (weight, dw)
        for weight, dw in summed.values():   # one at a time: a single dW lives at once
            torch.autograd.backward(weight, dw.to(weight.dtype))


def weight_grad(inp: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``dW`` of ``y = x Wᵀ``, the product autograd forms for ``F.linear`` (``grad_outputᵀ · x``, flattened; in
    the gradient's dtype, which is the matmul's under autocast)."""
    flat = inp.reshape(-1, inp.shape[-1]).to(grad_output.dtype)
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(flat)


_QUEUE: ContextVar[Optional[WeightGradQueue]] = ContextVar("weight_grad_queue", default=None)


@contextmanager
def collect_weight_grads(queue: WeightGradQueue) -> Iterator[WeightGradQueue]:
    """Marked linears whose forward runs inside leave their weight gradients in ``queue``."""
    token = _QUEUE.set(queue)
    try:
        yield queue
    finally:
        _QUEUE.reset(token)


def enable_deferred_weight_grads(module: nn.Module) -> int:
    """Mark every column-/row-parallel linear of ``module`` (those with a ``defer_weight_grad`` switch; see the
    module doc); returns how many."""
    marked = 0
    for layer in module.modules():
        if isinstance(getattr(layer, "defer_weight_grad", None), bool):
            setattr(layer, "defer_weight_grad", True)
            marked += 1
    return marked


@eager_under_compile   # a graph break: the queue is Python state (torch._dynamo is imported only when compiling)
def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; inside ``collect_weight_grads`` with autograd on, its weight gradient
    waits in the queue.

    The weight is no input of the autograd graph (it travels in a tuple): a backward that reached its
    accumulator with no gradient would still fire its post-accumulate hooks (which add ``.grad`` into the
    buffers). When nothing else of the call needs a gradient (a frozen first layer), a throwaway leaf keeps
    the output in the graph, so ``B`` still hands the weight's work to the queue.
    """
    queue = _QUEUE.get()
    if queue is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    anchor = None
    if not (x.requires_grad or (bias is not None and bias.requires_grad)):
        anchor = torch.empty(0, device=x.device, requires_grad=True)
    return _DeferredWeightLinear.apply(x, bias, anchor, (weight, queue))


class _DeferredWeightLinear(torch.autograd.Function):
    """``F.linear`` whose backward gives the input and bias gradients as autograd forms them (``g·W`` and the
    sum of ``g`` over tokens) and leaves ``(weight, input, g)`` in the queue."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: Optional[torch.Tensor], anchor: Optional[torch.Tensor],
                target: Tuple[torch.Tensor, WeightGradQueue]) -> torch.Tensor:
        weight, queue = target
        # multiply in what F.linear would under autocast (dW is cast back in W)
        w, b = in_autocast_dtype(weight, x), None if bias is None else in_autocast_dtype(bias, x)
        x = in_autocast_dtype(x, x)
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.queue, ctx.has_bias = weight, queue, bias is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, w = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = flat.mm(w).view(*grad.shape[:-1], w.shape[1]) if ctx.needs_input_grad[0] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        ctx.queue.add(ctx.weight, x, grad)
        return grad_x, grad_b, None, None
