"""Tensor parallelism (seed 002, section 3): collectives, parallel layers, cross-entropy, RNG."""

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, init_method_normal, init_sharded_,
    scaled_init_method_normal,
)
from .mappings import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region,
)
from .random import (
    EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint, get_rng_tracker, model_parallel_seed,
)
from .token_ids import CHECK_IDS_ENV, check_ids_in_vocab, check_ids_on_host
from .utils import (
    allreduce_sequence_parallel_grads, divide, pad_vocab_size, param_is_not_tensor_parallel_duplicate,
    param_is_tensor_parallel, split_tensor_along_last_dim, vocab_range,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "RNGStatesTracker", "MODEL_PARALLEL_RNG", "EXPERT_PARALLEL_RNG", "model_parallel_seed", "get_rng_tracker",
    "checkpoint", "init_method_normal", "scaled_init_method_normal", "init_sharded_", "divide",
    "pad_vocab_size", "vocab_range", "split_tensor_along_last_dim", "param_is_tensor_parallel",
    "param_is_not_tensor_parallel_duplicate", "allreduce_sequence_parallel_grads", "CHECK_IDS_ENV",
    "check_ids_in_vocab", "check_ids_on_host",
]
