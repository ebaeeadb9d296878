"""Build only this rank's layers of one pipeline chunk, each seeded by its global index.

Which layers a stage and virtual chunk hold is the pure split of ``parallel.stages`` (seed 000's
offsets); building them here, with a seed per global layer index, makes every layout hold the same
model as one process. ``TransformerBlock`` and ``pipeline.PipelineStack`` both build through it.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from torch import nn

from ..parallel import get_parallel_state
from ..parallel.stages import chunk_layer_range
from .init import seeded


def build_stage_layers(num_layers: int, build_layer: Callable[[int], nn.Module], init_seed: int,
                       vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None,
                       layout: Optional[Sequence[int]] = None) -> Tuple[nn.ModuleList, List[int]]:
    """This rank's layers of chunk ``vp_rank`` and their global (0-based) indices; ``layout``: every virtual
    stage's layer count (``parallel.stages.check_layout``) instead of the even or pinned split."""
    state = get_parallel_state()
    indices = list(chunk_layer_range(num_layers, state.pp_size, state.pp_rank, state.virtual_pipeline_size,
                                     vp_rank, first_stage_layers, last_stage_layers, layout))
    layers = []
    for index in indices:
        with seeded(init_seed, "layer", index):
            layers.append(build_layer(index))
    return nn.ModuleList(layers), indices
