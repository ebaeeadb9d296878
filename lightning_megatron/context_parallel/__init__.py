"""Context parallelism: the sequence split over the cp ranks (data side) and the reductions over cp.

The attention that exchanges keys/values lives with the other attention code, in
``lightning_megatron.transformer.context_parallel``.
"""

from .collectives import all_gather_context_parallel, context_parallel_first_token, context_parallel_loss_mean
from .split import (
    check_sequence_length, chunk_order, context_parallel_position_ids, gather_context_parallel_slices,
    local_chunks, sequence_keys, split_for_context_parallel,
)

__all__ = ["all_gather_context_parallel", "check_sequence_length", "chunk_order", "context_parallel_first_token",
           "context_parallel_loss_mean", "context_parallel_position_ids", "gather_context_parallel_slices",
           "local_chunks", "sequence_keys", "split_for_context_parallel"]
