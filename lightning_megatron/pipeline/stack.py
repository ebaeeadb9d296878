"""Build only this rank's pipeline chunk of a stack of layers, and run it.

``PipelineStack`` is what ``TransformerBlock`` does for transformer layers, offered for a
user's own layers: ``PipelineStack(lambda i: MyBlock(...), num_layers=24)`` builds, on each
rank, only the layers of its stage and virtual chunk (seed 000's offsets), each initialised
from a seed that depends on its global index, so every layout holds the same model.
On stages after the first the input is the activation received from the previous stage,
handed over with ``set_input_tensor`` (the executor's convention).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from ..parallel import get_parallel_state
from .stages import chunk_layer_range


def chunk_position(vp_rank: int = 0) -> Tuple[bool, bool]:
    """(is first chunk of the whole model, is last chunk) for this rank's local chunk ``vp_rank``."""
    state = get_parallel_state()
    vp_size = state.virtual_pipeline_size or 1
    if not 0 <= vp_rank < vp_size:
        raise ValueError(f"vp_rank={vp_rank} is out of range for virtual_pipeline_size={vp_size}.")
    first = state.pp_rank == 0 and vp_rank == 0
    last = state.pp_rank == state.pp_size - 1 and vp_rank == vp_size - 1
    return first, last


def build_stage_layers(num_layers: int, build_layer: Callable[[int], nn.Module], init_seed: int,
                       vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None) -> Tuple[nn.ModuleList, List[int]]:
    """This rank's layers of chunk ``vp_rank`` and their global (0-based) indices."""
    from ..transformer.init import seeded  # runtime import: transformer builds on pipeline

    state = get_parallel_state()
    indices = list(chunk_layer_range(num_layers, state.pp_size, state.pp_rank, state.virtual_pipeline_size,
                                     vp_rank, first_stage_layers, last_stage_layers))
    layers = []
    for index in indices:
        with seeded(init_seed, "layer", index):
            layers.append(build_layer(index))
    return nn.ModuleList(layers), indices


class PipelineStack(nn.Module):
    """A user's stack of layers, split over pipeline stages; ``forward(x)`` runs this rank's chunk."""

    def __init__(self, build_layer: Callable[[int], nn.Module], num_layers: int, init_seed: int = 1234,
                 vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None) -> None:
        super().__init__()
        self.layers, self.layer_indices = build_stage_layers(num_layers, build_layer, init_seed, vp_rank,
                                                             first_stage_layers, last_stage_layers)
        self.pre_process, self.post_process = chunk_position(vp_rank)
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def forward(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError("PipelineStack on a later stage needs set_input_tensor(...) before forward; "
                                   "the pipeline executor does this.")
            x = self.input_tensor
        for layer in self.layers:
            x = layer(x)
        return x
