"""What the strategy's setup does to the model's transformer layers, in Lightning's terms: compiles them (or, under
``compile_layers="auto"``, leaves each to decide at its first call, said once on rank 0) and resolves the
gradient-accumulation fusion default that depends on it, again for each layer that decides later."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..transformer.compile import CompileLayers, apply_compile_layers
from ..transformer.grad_accumulation_default import resolve_gradient_accumulation_fusion, resolve_layer_fusion


def prepare_layers(model: nn.Module, compile_layers: CompileLayers, device: torch.device, cp: int,
                   cuda_graph: Optional[str], report: Callable[[str], None] = rank_zero_info) -> Tuple[int, int]:
    """``compile_layers`` on ``model`` at context-parallel size ``cp`` (see ``transformer/compile.py``), then
    ``gradient_accumulation_fusion="auto"`` (``transformer/grad_accumulation_default.py``): how many layers were
    compiled or left to decide, and how many linears fuse now."""
    graphs = cuda_graph is not None
    compiled = apply_compile_layers(model, compile_layers, device, cp, cuda_graph == "full", report=report,
                                    on_bound=functools.partial(resolve_layer_fusion, cuda_graphs=graphs))
    return compiled, resolve_gradient_accumulation_fusion(model, graphs)
