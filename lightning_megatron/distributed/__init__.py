"""Gradient reduction across the parallel groups, global-norm clipping, micro-batch splitting."""

from .clip import clip_grad_norm, global_grad_norm
from .finalize import finalize_model_grads
from .microbatches import split_into_microbatches

__all__ = ["clip_grad_norm", "finalize_model_grads", "global_grad_norm", "split_into_microbatches"]
