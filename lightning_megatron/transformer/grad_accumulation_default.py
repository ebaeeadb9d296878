"""What ``gradient_accumulation_fusion="auto"`` (the default) comes to, decided once the strategy compiled the layers.

The fused accumulation (``tensor_parallel/grad_accumulation.py``: a weight's gradient summed over micro-batches by
its GEMM, ``addmm_``) measured faster where the linears are traced into compiled layers: the Llama-3-8B layer shape
on one H200 818.4 -> 815.1 ms a step, at TP2 + SP 465.5 -> 457.5 ms (benchmarks/RESULTS.md). It stays off

- in eager layers: each linear then goes through an autograd function of its own, host work that a host-bound
  model (BERT-base eager) pays for and that was not measured to win;
- under CUDA graphs (``cuda_graph="partial"`` or ``"full"``): a compiled layer's accumulation cannot be captured (a
  replay would add into the tensor of the capture and call no hook), and an eager one falls back under capture;
- in linears that run outside the compiled code (an MoE layer's shared experts: only its attention block is
  compiled), as ``compile.compiled_modules`` says;
- in float8 linears (``enable_fp8``, which the strategy runs first): torchao's float8 matmul forms their weight
  gradient itself.

``True`` and ``False`` are left as they are.
"""

from __future__ import annotations

from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .compile import compiled_modules

_LINEARS = (ColumnParallelLinear, RowParallelLinear)


def resolve_gradient_accumulation_fusion(model: nn.Module, cuda_graphs: bool) -> int:
    """Decide ``"auto"`` on every linear of ``model`` (see the module): on where its forward runs in a transformer
    layer's compiled code (``compile.compiled_modules``) when ``cuda_graphs`` is False, else off. Returns how many
    linears it turned on."""
    from .layer import TransformerLayer

    return sum(resolve_layer_fusion(layer, cuda_graphs) for layer in model.modules()
               if isinstance(layer, TransformerLayer))


def resolve_layer_fusion(layer: nn.Module, cuda_graphs: bool) -> int:
    """:func:`resolve_gradient_accumulation_fusion` for one transformer layer (``compile_layers="auto"`` decides
    again once a layer's first call has bound its bodies eager or compiled)."""
    compiled = {id(m) for module in compiled_modules(layer) for m in module.modules() if isinstance(m, _LINEARS)}
    turned_on = 0
    for linear in layer.modules():
        if isinstance(linear, _LINEARS) and linear.grad_accumulation_fusion == "auto":
            linear.accumulate_weight_grads = id(linear) in compiled and not cuda_graphs and linear.float8 is None
            turned_on += linear.accumulate_weight_grads
    return turned_on
