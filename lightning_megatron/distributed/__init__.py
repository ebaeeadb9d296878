"""Gradient reduction across the parallel groups, global-norm clipping, gradient
buffers with bucketed (overlapped) data-parallel reduction, and the distributed optimizer (ZeRO-1)."""

from .config import GradientConfig
from .clip import clip_grad_norm, global_grad_norm
from .data_parallel import DataParallelGrads, default_bucket_size
from .distributed_optimizer import DistributedOptimizer, check_shardable
from .finalize import finalize_model_grads
from .grad_buffer import BucketSpec, GradBuffer, bucket_layout
from .optimizer_state import FullOptimizerView, full_state_dict, load_full_state_dict
from .param_buffer import ParamBuffer, ParamGather

__all__ = ["BucketSpec", "GradientConfig", "DataParallelGrads", "DistributedOptimizer", "FullOptimizerView", "GradBuffer", "ParamBuffer",
           "ParamGather", "bucket_layout", "check_shardable", "clip_grad_norm", "default_bucket_size", "finalize_model_grads",
           "full_state_dict", "global_grad_norm", "load_full_state_dict"]
