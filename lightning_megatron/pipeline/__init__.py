"""Pipeline parallelism: pure schedules and layer split (this package's pure part)."""

from .schedules import (
    BACKWARD, FORWARD, MicrobatchCounts, ScheduleStep, convert_schedule_table_to_order,
    convert_schedule_table_to_steps, get_pp_rank_microbatches,
    get_schedule_table, resolve_group_size, schedule_order, schedule_steps,
)
from .stages import (
    chunk_layer_range, layer_offset, layers_per_chunk, stage_layer_ranges, virtual_stage,
)

__all__ = [
    "BACKWARD", "FORWARD", "MicrobatchCounts", "ScheduleStep", "chunk_layer_range",
    "convert_schedule_table_to_order", "convert_schedule_table_to_steps",
    "get_pp_rank_microbatches", "get_schedule_table", "layer_offset", "layers_per_chunk",
    "resolve_group_size", "schedule_order", "schedule_steps", "stage_layer_ranges",
    "virtual_stage",
]
