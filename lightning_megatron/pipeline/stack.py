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

from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..parallel import ParallelConfigError, chunk_position, get_parallel_state
from ..parallel.stage_balance import balanced_layout
from ..parallel.stages import check_layout, split_layout
from ..transformer.stage_layers import build_stage_layers


class PipelineStack(nn.Module):
    """A user's stack of layers, split over pipeline stages; ``forward(x)`` runs this rank's chunk."""

    def __init__(self, build_layer: Callable[[int], nn.Module], num_layers: int, init_seed: int = 1234,
                 vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None,
                 pipeline_layout: Union[None, str, Sequence[int]] = None,
                 layer_costs: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        self.pipeline_layout: Tuple[int, ...] = _stack_layout(num_layers, pipeline_layout, layer_costs,
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


def _stack_layout(num_layers: int, pipeline_layout: Union[None, str, Sequence[int]],
                  layer_costs: Optional[Sequence[int]], first: Optional[int], last: Optional[int]) -> Tuple[int, ...]:
    state = get_parallel_state()
    pp, vp = state.pp_size, state.virtual_pipeline_size
    if pipeline_layout in (None, "even"):
        return split_layout(num_layers, pp, vp, first, last)
    if first is not None or last is not None:
        raise ParallelConfigError(f"PipelineStack pipeline_layout={pipeline_layout!r} and first_stage_layers/"
                                  f"last_stage_layers both say how to split the layers: give one of them.")
    if pipeline_layout == "balanced":
        if layer_costs is None or len(layer_costs) != num_layers:
            raise ParallelConfigError(
                f"PipelineStack pipeline_layout='balanced' needs layer_costs, one number per layer ({num_layers}), "
                f"got {None if layer_costs is None else len(layer_costs)}; or give pipeline_layout as a list.")
        return balanced_layout([int(c) for c in layer_costs], pp, vp)
    return check_layout(pipeline_layout, num_layers, pp, vp)
