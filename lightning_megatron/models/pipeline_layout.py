"""The models' ``pipeline_layout`` argument: which layers each pipeline stage (and virtual chunk) builds.

``None`` (the default) and ``"balanced"`` balance the stages by counted cost (``parallel.stage_balance`` over
``transformer.stage_costs``: the layers, dense or MoE, the embedding on the first chunk, the output layer and loss
on the last); ``"even"`` is the equal split; a list gives every virtual stage's layer count in model order by hand.
``first_stage_layers``/``last_stage_layers`` (Megatron-Core's uneven ends) keep working when no layout is given.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from ..parallel import get_parallel_state
from ..parallel.stage_balance import PipelineLayout, resolve_layout
from ..transformer.stage_costs import ModelCosts

__all__ = ["PipelineLayout", "resolve_pipeline_layout"]


def resolve_pipeline_layout(pipeline_layout: PipelineLayout, num_layers: int, costs: Callable[[], ModelCosts],
                            first_stage_layers: Optional[int] = None,
                            last_stage_layers: Optional[int] = None) -> Tuple[int, ...]:
    """Layers per virtual stage (model order) for this run's pipeline sizes; balanced by default."""
    state = get_parallel_state()

    def stack_costs() -> Tuple[list, int, int]:
        model = costs()
        return model.layers, model.embedding, model.head

    return resolve_layout(pipeline_layout, num_layers, state.pp_size, state.virtual_pipeline_size, stack_costs,
                          first_stage_layers, last_stage_layers, default="balanced")
