"""The model's ``pipeline_layout`` argument: which layers each pipeline stage (and virtual chunk) builds.

``None`` (the default) and ``"balanced"`` balance the stages by counted cost (``parallel.stage_balance``
over ``transformer.stage_costs``: the layers, dense or MoE, the embedding on the first chunk, the output
layer and loss on the last); ``"even"`` is the equal split; a list gives every virtual stage's layer count
in model order by hand. ``first_stage_layers``/``last_stage_layers`` (Megatron-Core's uneven ends) keep
working when no layout is given. Every rank computes the same tuple from the same configuration.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Tuple, Union

from ..parallel import ParallelConfigError, get_parallel_state
from ..parallel.stage_balance import balanced_layout
from ..parallel.stages import check_layout, split_layout
from ..transformer.stage_costs import ModelCosts

__all__ = ["PipelineLayout", "resolve_pipeline_layout"]

PipelineLayout = Union[None, str, Sequence[int]]


@functools.lru_cache(maxsize=64)
def _balanced(layers: Tuple[int, ...], pp: int, vp: int, embedding: int, head: int) -> Tuple[int, ...]:
    return balanced_layout(layers, pp, vp, embedding, head)


def resolve_pipeline_layout(pipeline_layout: PipelineLayout, num_layers: int, costs: Callable[[], ModelCosts],
                            first_stage_layers: Optional[int] = None,
                            last_stage_layers: Optional[int] = None) -> Tuple[int, ...]:
    """Layers per virtual stage (model order) for this run's pipeline sizes; ``costs`` is called only when
    balancing."""
    state = get_parallel_state()
    pp, vp = state.pp_size, state.virtual_pipeline_size or 1
    pinned = first_stage_layers is not None or last_stage_layers is not None
    if pipeline_layout is None:
        pipeline_layout = "even" if pinned or pp == 1 else "balanced"
    elif pinned:
        raise ParallelConfigError(
            f"pipeline_layout={pipeline_layout!r} and first_stage_layers/last_stage_layers both say how to split the "
            f"layers: give one of them (pipeline_layout=[...] gives every stage its count).")
    if pipeline_layout == "even":
        return split_layout(num_layers, pp, vp if vp > 1 else None, first_stage_layers, last_stage_layers)
    if pipeline_layout == "balanced":
        if pp == 1:
            return (num_layers,)
        model = costs()
        if len(model.layers) != num_layers:
            raise ValueError(f"the cost model counted {len(model.layers)} layers for num_layers={num_layers}.")
        return _balanced(tuple(model.layers), pp, vp, model.embedding, model.head)
    return check_layout(pipeline_layout, num_layers, pp, vp if vp > 1 else None)
