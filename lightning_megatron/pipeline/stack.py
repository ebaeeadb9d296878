"""Build only this rank's pipeline chunk of a stack of layers, and run it.

``PipelineStack`` is what ``TransformerBlock`` does for transformer layers, offered for a
user's own layers: ``PipelineStack(lambda i: MyBlock(...), num_layers=24)`` builds, on each
rank, only the layers of its stage and virtual chunk (seed 000's offsets), each initialised
from a seed that depends on its global index, so every layout holds the same model.
On stages after the first the input is the activation received from the previous stage,
handed over with ``set_input_tensor`` (the executor's convention). ``pipeline_layout``: None or ``"even"`` (the
equal split), a list of every virtual stage's layer count in model order, or ``"balanced"`` with ``layer_costs``
(one number per layer, any unit) for stacks whose layers cost differently; ``self.pipeline_layout`` is the result
(the strategy logs it at setup).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..parallel import chunk_position, get_parallel_state
from ..parallel.stage_balance import PipelineLayout, resolve_layout
from ..transformer.stage_layers import build_stage_layers


class PipelineStack(nn.Module):
    """A user's stack of layers, split over pipeline stages; ``forward(x)`` runs this rank's chunk."""

    def __init__(self, build_layer: Callable[[int], nn.Module], num_layers: int, init_seed: int = 1234,
                 vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None,
                 pipeline_layout: PipelineLayout = None, layer_costs: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        state = get_parallel_state()
        costs = None if layer_costs is None else (lambda: (layer_costs, 0, 0))
        self.pipeline_layout: Tuple[int, ...] = resolve_layout(pipeline_layout, num_layers, state.pp_size,
                                                               state.virtual_pipeline_size, costs,
                                                               first_stage_layers, last_stage_layers)
        self.layers, self.layer_indices = build_stage_layers(num_layers, build_layer, init_seed, vp_rank,
                                                             layout=self.pipeline_layout)
        self.pre_process, self.post_process = chunk_position(vp_rank)
        self.input_tensor: Optional[torch.Tensor] = None

    def graphable_layers(self) -> nn.ModuleList:
        """This stage's layers, run one after another (per-layer CUDA graphs chain them)."""
        return self.layers

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def forward(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError("PipelineStack on a later stage needs set_input_tensor(...) before forward; "
                                   "the pipeline executor does this.")
            x = self.input_tensor
        assert x is not None, "PipelineStack on the first stage needs its input x"
        for layer in self.layers:
            x = layer(x)
        return x

