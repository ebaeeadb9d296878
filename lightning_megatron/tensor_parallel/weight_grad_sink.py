"""Linears whose weight gradient goes to a sink of their own instead of autograd.

``F.linear``'s backward forms the input and bias gradients, which autograd passes on, and the weight gradient
``dW = gᵀ·x``. Two features take ``dW``'s operands out of autograd: the zero-bubble schedule queues them for its
``W`` step (``deferred_wgrad.py``), gradient-accumulation fusion adds the product into the parameter's gradient
in one GEMM (``grad_accumulation.py``). Both need the same linear, given the sink:

- eager: an autograd function that holds the weight in a tuple (no autograd edge: ``AccumulateGrad`` must not
  add it again) and calls ``sink(parameter, input, grad_output)`` in its backward; a throwaway leaf keeps a
  frozen input's output in the graph (a frozen first layer still hands its weight's work over);
- under ``torch.compile``: traced into the layer's graph, the weight passed detached, its backward calling the
  feature's side-effecting custom op ``op(input, grad_output, weight_alias)``, which finds the parameter from the
  alias (``sink_parameter``: among the linears registered with ``register_sink_weight``). The graph keeps its
  own autograd edge to the weight, which reaches the weight's accumulator with no gradient: its post-accumulate
  hooks are called there once without a new gradient (the data-parallel buffers ignore such a call,
  ``distributed/data_parallel.py``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import eager_under_compile
from .utils import in_autocast_dtype

#: ``(parameter, input, grad_output) -> None``: where the eager path's weight-gradient operands go
WeightGradSink = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

# the compiled path's ops, defined with the low-level library API: a call costs ~2 us of host time where
# ``torch.library.custom_op``'s wrappers cost ~9 us (one call per linear per micro-batch in every backward)
_LIBRARY = torch.library.Library("lightning_megatron", "FRAGMENT")


# the linears whose weight a compiled backward may pass to a sink op (as the graph's detached alias), and, rebuilt
# from them whenever a lookup misses (a move or a cast changes the addresses), each weight by its data address
_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_BY_ADDRESS: Dict[int, "weakref.ReferenceType[torch.Tensor]"] = {}


def register_sink_weight(module: nn.Module) -> None:
    """``module.weight`` may reach a sink op through a compiled graph (idempotent)."""
    _MODULES.add(module)


def sink_parameter(alias: torch.Tensor, registered_by: str) -> torch.Tensor:
    """The parameter ``alias`` is (eager) or shares memory with (compiled: the graph's detached copy), among the
    registered linears' weights; ``registered_by`` names what registers them, for the error."""
    if alias.is_leaf and alias.requires_grad:
        return alias
    for attempt in range(2):
        ref = _BY_ADDRESS.get(alias.data_ptr())
        param = None if ref is None else ref()
        if param is not None and param.shape == alias.shape and param.data_ptr() == alias.data_ptr():
            return param
        if attempt == 0:   # moved or cast since the last lookup: the addresses again
            _BY_ADDRESS.clear()
            for module in list(_MODULES):
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor):
                    _BY_ADDRESS[weight.data_ptr()] = weakref.ref(weight)
    raise RuntimeError(f"a linear's weight (shape {tuple(alias.shape)}) reached a compiled weight-gradient op but "
                       f"belongs to no linear {registered_by} registered.")


def define_sink_op(name: str, body: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> Any:
    """``torch.ops.lightning_megatron.<name>(input, grad_output, weight_alias) -> ()`` running ``body``: opaque to the
    compiler, and marked as a side effect (it returns nothing: without the mark, dead-code elimination drops it from
    the backward graph)."""
    _LIBRARY.define(f"{name}(Tensor inp, Tensor grad_output, Tensor weight) -> ()")
    _LIBRARY.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lightning_megatron::{name}", lambda inp, grad_output, weight: None, lib=_LIBRARY)
    op = getattr(torch.ops.lightning_megatron, name)
    torch.fx.node.has_side_effect(op.default)
    return op


def input_and_bias_grads(ctx: Any, grad: torch.Tensor, w: torch.Tensor, x_index: int, bias_index: int
                         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``g·W`` and the sum of ``g`` over tokens, as autograd forms them for ``F.linear``."""
    flat = grad.reshape(-1, grad.shape[-1])
    grad_x = flat.mm(w).view(*grad.shape[:-1], w.shape[1]) if ctx.needs_input_grad[x_index] else None
    grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[bias_index] else None
    return grad_x, grad_b


def traced_sink_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], op: Any) -> torch.Tensor:
    """The compiled path (call it while ``torch.compiler.is_compiling()`` and ``x`` or the bias needs a gradient)."""
    b = None if bias is None else in_autocast_dtype(bias, x)
    out: torch.Tensor = _TracedSinkLinear.apply(in_autocast_dtype(x, x), in_autocast_dtype(weight.detach(), x), b,
                                                weight.detach(), op)
    return out


@eager_under_compile   # a frozen input under compile: the throwaway leaf below is made eagerly
def eager_sink_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      sink: WeightGradSink) -> torch.Tensor:
    """The eager path (see the module)."""
    anchor = None
    if not (x.requires_grad or (bias is not None and bias.requires_grad)):
        anchor = torch.empty(0, device=x.device, requires_grad=True)
    out: torch.Tensor = _EagerSinkLinear.apply(x, bias, anchor, (weight,), sink)
    return out


class _EagerSinkLinear(torch.autograd.Function):
    """``F.linear`` whose backward gives the input and bias gradients and ``(weight, input, g)`` to the sink."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: Optional[torch.Tensor], anchor: Optional[torch.Tensor],
                target: Tuple[torch.Tensor], sink: WeightGradSink) -> torch.Tensor:
        weight, = target
        # multiply in what F.linear would under autocast (the sink casts dW back)
        w, b = in_autocast_dtype(weight, x), None if bias is None else in_autocast_dtype(bias, x)
        x = in_autocast_dtype(x, x)
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.has_bias, ctx.sink = weight, bias is not None, sink
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, w = ctx.saved_tensors
        grad_x, grad_b = input_and_bias_grads(ctx, grad, w, 0, 1)
        ctx.sink(ctx.weight, x, grad)
        return grad_x, grad_b, None, None, None


class _TracedSinkLinear(torch.autograd.Function):
    """The same under ``torch.compile``: ``w`` is the (cast) weight detached, ``weight`` the parameter's detached
    alias; the hand-over is the custom op ``op``, so the backward stays one graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                weight: torch.Tensor, op: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w, weight)
        ctx.has_bias, ctx.op = bias is not None, op
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, w, weight = ctx.saved_tensors
        grad_x, grad_b = input_and_bias_grads(ctx, grad, w, 0, 2)
        ctx.op(x, grad, weight)
        return grad_x, None, grad_b, None, None
