"""What ``gradient_accumulation_fusion="auto"`` (the default) comes to, decided once the strategy compiled the layers.

The fused accumulation (``tensor_parallel/grad_accumulation.py``: a weight's gradient summed over micro-batches by
its GEMM, ``addmm_``) measured faster where the linears are traced into compiled layers: the Llama-3-8B layer shape
on one H200 818.4 -> 815.1 ms a step, at TP2 + SP 465.5 -> 457.5 ms (benchmarks/RESULTS.md). It stays off

- in eager layers: each linear then goes through an autograd function of its own, host work that a host-bound
  model (BERT-base eager) pays for and that was not measured to win;
- under CUDA graphs (``cuda_graph="partial"`` or ``"full"``): a compiled layer's accumulation cannot be captured (a
  replay would add into the tensor of the capture and call no hook), and an eager one falls back under capture;
- in MoE layers' experts and shared experts (their MLP runs eagerly: only the attention block is compiled).

``True`` and ``False`` are left as they are.
"""

from __future__ import annotations

from typing import Iterator, Union

from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .compile import compiled_bodies


def _is_compiled(layer: nn.Module) -> bool:
    return bool(compiled_bodies(layer)) or getattr(layer, "_compiled_call_impl", None) is not None


def _linears_outside_moe(module: nn.Module) -> Iterator[Union[ColumnParallelLinear, RowParallelLinear]]:
    from ..moe.layer import MoELayer

    if isinstance(module, MoELayer):
        return
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        yield module
    for child in module.children():
        yield from _linears_outside_moe(child)


def resolve_gradient_accumulation_fusion(model: nn.Module, cuda_graphs: bool) -> int:
    """Decide ``"auto"`` on every linear of ``model`` (see the module): on in the compiled transformer layers'
    attention and dense MLPs when ``cuda_graphs`` is False, else off. Returns how many linears it turned on."""
    from .layer import TransformerLayer

    turned_on = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        fused = _is_compiled(layer) and not cuda_graphs
        for linear in _linears_outside_moe(layer):
            if linear.grad_accumulation_fusion == "auto":
                linear.accumulate_weight_grads = fused
                turned_on += fused
    return turned_on
