"""Pipeline parallelism: pure schedules, layer split and communication plan; p2p and executors."""

from typing import TYPE_CHECKING

from .._lazy import lazy_face
# named like its module: bound here, since importing the submodule later would rebind the package attribute to
# the module and a lazy __getattr__ would never be asked (comm_plan is pure: no torch)
from .comm_plan import CommRound, comm_plan

__getattr__, __dir__ = lazy_face(__name__, {
    'VirtualChunks': '.chunks',
    'ForwardStepFn': '.executor',
    'PipelineOutput': '.executor',
    'StepContext': '.executor',
    'deallocate_output_tensor': '.executor',
    'forward_backward': '.executor',
    'PipelineP2P': '.p2p',
    'prepare_group_for_batched_p2p': '.p2p',
    'BACKWARD': '.schedules',
    'FORWARD': '.schedules',
    'MicrobatchCounts': '.schedules',
    'ScheduleStep': '.schedules',
    'convert_schedule_table_to_order': '.schedules',
    'convert_schedule_table_to_steps': '.schedules',
    'get_pp_rank_microbatches': '.schedules',
    'get_schedule_table': '.schedules',
    'resolve_group_size': '.schedules',
    'schedule_order': '.schedules',
    'schedule_steps': '.schedules',
    'WEIGHT': '.schedules',
    'bubble_fraction': '.zero_bubble',
    'zero_bubble_h1_schedule': '.zero_bubble',
    'allreduce_shared_embedding_grads': '.shared_embeddings',
    'check_tied_optimizer_settings': '.shared_embeddings',
    'shared_embedding_parameters': '.shared_embeddings',
    'sync_shared_embedding_weights': '.shared_embeddings',
    'PipelineStack': '.stack',
    'balanced_layout': '..parallel.stage_balance',
    'stage_costs': '..parallel.stage_balance',
    'check_layout': '..parallel.stages',
    'split_layout': '..parallel.stages',
    'chunk_layer_range': '..parallel.stages',
    'layer_offset': '..parallel.stages',
    'layers_per_chunk': '..parallel.stages',
    'stage_layer_ranges': '..parallel.stages',
    'virtual_stage': '..parallel.stages',
})

if TYPE_CHECKING:
    from .chunks import VirtualChunks
    from .executor import (
        ForwardStepFn, PipelineOutput, StepContext, deallocate_output_tensor, forward_backward,
    )
    from .p2p import PipelineP2P, prepare_group_for_batched_p2p
    from .schedules import (
        BACKWARD, FORWARD, MicrobatchCounts, ScheduleStep, convert_schedule_table_to_order,
        convert_schedule_table_to_steps, get_pp_rank_microbatches,
        get_schedule_table, resolve_group_size, schedule_order, schedule_steps, WEIGHT,
    )
    from .zero_bubble import bubble_fraction, zero_bubble_h1_schedule
    from .shared_embeddings import (
        allreduce_shared_embedding_grads, check_tied_optimizer_settings, shared_embedding_parameters,
        sync_shared_embedding_weights,
    )
    from .stack import PipelineStack
    from ..parallel.stage_balance import balanced_layout, stage_costs
    from ..parallel.stages import (
        check_layout, chunk_layer_range, layer_offset, layers_per_chunk, split_layout, stage_layer_ranges,
        virtual_stage,
    )

__all__ = [
    "BACKWARD", "FORWARD", "MicrobatchCounts", "ScheduleStep", "balanced_layout", "check_layout",
    "chunk_layer_range", "split_layout", "stage_costs",
    "convert_schedule_table_to_order", "convert_schedule_table_to_steps",
    "get_pp_rank_microbatches", "get_schedule_table", "layer_offset", "layers_per_chunk",
    "resolve_group_size", "schedule_order", "schedule_steps", "stage_layer_ranges",
    "virtual_stage", "WEIGHT", "bubble_fraction", "zero_bubble_h1_schedule",
    # runtime
    "CommRound", "ForwardStepFn", "PipelineOutput", "PipelineP2P", "StepContext",
    "allreduce_shared_embedding_grads", "check_tied_optimizer_settings", "comm_plan", "deallocate_output_tensor",
    "forward_backward", "prepare_group_for_batched_p2p", "shared_embedding_parameters",
    "sync_shared_embedding_weights",
    # building a stage's share of a model
    "PipelineStack", "VirtualChunks",
]
