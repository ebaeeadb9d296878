"""Backward split for the zero-bubble schedule: input gradients now, weight gradients later (``W``).

A zero-bubble pipeline sends a micro-batch's input gradient upstream as soon as it exists and runs the
weight-gradient GEMMs where the stage would otherwise wait (``pipeline/zero_bubble.py``). Here is the
split, for the column- and row-parallel linears (the bulk of a layer's weight FLOPs):

- ``enable_deferred_weight_grads(module)`` marks a model's linears (idempotent; the executor does it for
  the zero-bubble schedule). A marked linear computes, in its backward, the input (and bias) gradient only.
- Its backward run inside ``collect_weight_grads(queue)`` (the executor's ``B`` step of a micro-batch) leaves
  ``(weight, input, output gradient)`` in ``queue``; run outside any, the weight gradient is accumulated at
  once, as autograd would (a marked model trained by another loop loses nothing).
- ``queue.run()`` (the ``W`` step) computes each ``dW = grad_outputᵀ · input`` as autograd would and
  hands it to autograd as the weight's gradient: it lands in ``.grad`` (or ``main_grad``, through the
  buffers' hooks) and fires the same post-accumulate hooks, so overlapped data-parallel reduction starts
  when the weight's last ``W`` runs, not at its ``B``.

The queue is the one active when the backward runs, not when the forward ran: a layer recomputed inside ``B``
(activation recompute) defers too, and the queue is a process-wide stack, not a context variable, because
autograd runs a CUDA backward on its own thread.

Deferred: the weights of ``ColumnParallelLinear`` / ``RowParallelLinear`` called with their own weight.
Not deferred (computed in ``B`` as usual): biases, norms, embeddings, the output layer, expert weights
indexed per expert, a weight all-gathered before use (grouped-query kv shared over tp) and float8 matmuls.

Under ``torch.compile`` (compiled layers) a marked linear is traced into the layer's graph, not a graph
break: its backward hands its operands over through a side-effecting custom op
(``lightning_megatron::defer_weight_grad``), which copies them, since inductor may reuse an intermediate's memory
once its last op in the graph has run. The copies cost one read and write of each operand (the eager path keeps
the tensors themselves); the parameter is found again from the weight the graph passes (``_owner``; a move
or cast of the model since is found by the lookup itself). The compiled
graph keeps its own autograd edge to the weight, which reaches the weight's accumulator in ``B`` with no gradient:
its post-accumulate hooks are called there once without a new gradient (the data-parallel buffers ignore such a
call, ``distributed/data_parallel.py``), and again with it in ``W``.

Memory: each deferred linear keeps its input and its output gradient from ``B`` until ``W`` (the input
is what its backward saved anyway; under sequence parallelism that is the all-gathered input).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .weight_grad_sink import (define_sink_op, eager_sink_linear, register_sink_weight, sink_parameter,
                               traced_sink_linear)


class WeightGradQueue:
    """The weight-gradient work one micro-batch's input-gradient backward left for its ``W`` step."""

    def __init__(self) -> None:
        self._work: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (weight, input, grad_output)

    def __len__(self) -> int:
        return len(self._work)

    def add(self, weight: torch.Tensor, inp: torch.Tensor, grad_output: torch.Tensor) -> None:
        self._work.append((weight, inp, grad_output))

    def run(self) -> None:
        """Compute every deferred weight gradient and accumulate them through autograd (``.grad`` / hooks); a
        weight used twice gets its contributions summed first. One autograd call for them all, not one per weight
        (each call starts the engine again on the host)."""
        work, self._work = self._work, []
        summed: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, inp, grad_output in work:
            dw = weight_grad(inp, grad_output)
            if id(weight) in summed:
                dw = summed[id(weight)][1] + dw
            summed[id(weight)] = (weight, dw)
        if summed:
            torch.autograd.backward([weight for weight, _ in summed.values()],
                                    [dw.to(weight.dtype) for weight, dw in summed.values()])


def weight_grad(inp: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``dW`` of ``y = x Wᵀ``, the product autograd forms for ``F.linear`` (``grad_outputᵀ · x``, flattened; in
    the gradient's dtype, which is the matmul's under autocast)."""
    flat = inp.reshape(-1, inp.shape[-1]).to(grad_output.dtype)
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(flat)


# The B step's queue, innermost last: a plain list, read on autograd's threads too (see the module doc).
_ACTIVE: List[WeightGradQueue] = []


@contextmanager
def collect_weight_grads(queue: WeightGradQueue) -> Iterator[WeightGradQueue]:
    """Marked linears whose backward runs inside leave their weight gradients in ``queue``."""
    _ACTIVE.append(queue)
    try:
        yield queue
    finally:
        _ACTIVE.pop()


def hand_over(weight: torch.Tensor, inp: torch.Tensor, grad_output: torch.Tensor) -> None:
    """A marked linear's backward gives its weight-gradient operands: to the active queue, or, with none,
    accumulated now through autograd (a re-entrant backward, as ``W`` runs it)."""
    if _ACTIVE:
        _ACTIVE[-1].add(weight, inp, grad_output)
    else:
        torch.autograd.backward(weight, weight_grad(inp, grad_output).to(weight.dtype))


def enable_deferred_weight_grads(module: nn.Module) -> int:
    """Mark every column-/row-parallel linear of ``module`` (those with a ``defer_weight_grad`` switch; see the
    module doc) and register their weights for the compiled path's lookup; returns how many."""
    marked = 0
    for layer in module.modules():
        if isinstance(getattr(layer, "defer_weight_grad", None), bool):
            setattr(layer, "defer_weight_grad", True)
            register_sink_weight(layer)
            marked += 1
    return marked


def _owner(weight: torch.Tensor) -> torch.Tensor:
    """The parameter ``weight`` is (eager) or aliases (compiled: the graph's detached copy of it)."""
    return sink_parameter(weight, "enable_deferred_weight_grads")


def _defer_weight_grad(inp: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor) -> None:
    """The compiled backward's hand-over (copies: inductor may reuse the graph's buffers once this returns)."""
    hand_over(_owner(weight), inp.clone(), grad_output.clone())


_DEFER_OP = define_sink_op("defer_weight_grad", _defer_weight_grad)


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient, with autograd on, is handed over by its backward
    (``hand_over``: to the ``W`` step's queue; ``weight_grad_sink.py`` has the linear).

    Compiled, it is traced into the graph when the output is in the autograd graph through ``x`` or the bias
    (always, in a transformer layer); a frozen input takes the eager path as a graph break.
    """
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return traced_sink_linear(x, weight, bias, _DEFER_OP)
    return eager_sink_linear(x, weight, bias, hand_over)
