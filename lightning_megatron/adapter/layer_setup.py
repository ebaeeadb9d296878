"""What the strategy's setup does to the model's transformer layers, in Lightning's terms: compiles them (or, under
``compile_layers="auto"``, leaves each to decide at its first call, said once on rank 0) and resolves the
gradient-accumulation fusion default that depends on it."""

from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..transformer.compile import CompileLayers, apply_compile_layers
from ..transformer.grad_accumulation_default import resolve_gradient_accumulation_fusion


def prepare_layers(model: nn.Module, compile_layers: CompileLayers, device: torch.device, cp: int,
                   cuda_graph: Optional[str]) -> None:
    """``compile_layers`` on ``model`` at context-parallel size ``cp`` (see ``transformer/compile.py``), then
    ``gradient_accumulation_fusion="auto"`` (``transformer/grad_accumulation_default.py``)."""
    apply_compile_layers(model, compile_layers, device, cp, cuda_graph == "full", report=rank_zero_info)
    resolve_gradient_accumulation_fusion(model, cuda_graph is not None)
