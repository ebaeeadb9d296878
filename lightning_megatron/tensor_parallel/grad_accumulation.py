"""Weight gradients accumulated by their GEMM (``TransformerConfig.gradient_accumulation_fusion``).

Over several micro-batches a weight's gradient is a sum. Autograd forms each micro-batch's ``dW = gᵀ·x`` as a new
tensor and then adds it: into ``.grad`` (``AccumulateGrad``) or, with data-parallel buffers, into ``main_grad``
(their hook), one more read and write of the gradient per weight per micro-batch, and a transient ``dW``. Here a
column-/row-parallel linear's backward accumulates its product where the gradient lives, in one GEMM
(``addmm_``: C += gᵀ·x): Megatron-Core's gradient-accumulation fusion, without its CUDA extension. The parameter's
post-accumulate hooks are called as ``AccumulateGrad`` calls them, so the data-parallel buffers' overlapped
reduction still starts when a weight's gradient is complete (the buffers see ``param.grad_added_to_main_grad``).

Where the buffer's dtype differs from the product's (a float32 ``main_grad`` of bf16 matmuls), the product is
formed and then added: correct, no saving. An eager forward under CUDA-graph capture takes the plain path (the
capture would freeze the Python that picks the target); compiled layers inside a captured graph are refused at the
capture with the fix (the traced backward has already left the weight out of autograd). Float8 matmuls and the
zero-bubble schedule's deferred weights keep their own accumulation (``deferred_wgrad.py``: its ``W`` step).

Under ``torch.compile`` the linear is traced into the layer's graph: its backward calls the side-effecting custom op
``lightning_megatron::accumulate_weight_grad``, which finds the parameter from the graph's detached alias of it
(the linears register their weights at construction: ``weight_grad_sink.register_sink_weight``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .weight_grad_sink import define_sink_op, eager_sink_linear, sink_parameter, traced_sink_linear


def accumulate_weight_grad(param: torch.Tensor, inp: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``param``'s gradient += ``grad_outputᵀ · inp`` (flattened), in ``main_grad`` if it has one, else in ``.grad``
    (made by the first product); then its post-accumulate hooks, as ``AccumulateGrad`` would call them."""
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = inp.reshape(-1, inp.shape[-1]).to(g.dtype)
    main: Optional[torch.Tensor] = getattr(param, "main_grad", None)
    target = main if main is not None else param.grad
    with torch.no_grad():
        if target is None:
            param.grad = g.t().mm(x).to(param.dtype)
        elif target.dtype == g.dtype:
            target.addmm_(g.t(), x)
        else:
            target.add_(g.t().mm(x))
    if main is not None:
        param.grad_added_to_main_grad = True  # type: ignore[attr-defined]  # runtime attribute
    run_post_accumulate_grad_hooks(param)


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """``param``'s post-accumulate-grad hooks (``register_post_accumulate_grad_hook``: e.g. the data-parallel
    buffers'), as ``AccumulateGrad`` calls them, for code that accumulates a gradient outside autograd."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in list(hooks.values()) if hooks else []:
        hook(param)


def _accumulate_weight_grad(inp: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor) -> None:
    """The compiled backward's accumulation (consumed at once: no copies)."""
    if inp.is_cuda and torch.cuda.is_current_stream_capturing():
        # a replay would add into whatever tensor was the target at capture, and call no hook
        raise ValueError("gradient_accumulation_fusion=True does not combine compiled layers with CUDA graphs "
                         "(cuda_graph='partial' or 'full'): set gradient_accumulation_fusion=False, cuda_graph=None "
                         "or compile_layers=False.")
    accumulate_weight_grad(sink_parameter(weight, "gradient_accumulation_fusion=True"), inp, grad_output)


_ACCUMULATE_OP = define_sink_op("accumulate_weight_grad", _accumulate_weight_grad)


def accumulating_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward accumulates the weight's gradient itself (see the module;
    ``weight_grad_sink.py`` has the linear)."""
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return traced_sink_linear(x, weight, bias, _ACCUMULATE_OP)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():   # the graph would freeze the Python that picks
        return F.linear(x, weight, bias)                          # the target: autograd accumulates it
    return eager_sink_linear(x, weight, bias, accumulate_weight_grad)
