"""Pipeline-aware transformer blocks built from the tensor-parallel layers."""

from .attention import SelfAttention, attention_bias
from .block import TransformerBlock
from .config import TransformerConfig, model_defaults
from .init import seeded
from .layer import TransformerLayer
from .mlp import MLP
from .norm import build_norm

__all__ = ["MLP", "SelfAttention", "TransformerBlock", "TransformerConfig", "TransformerLayer",
           "attention_bias", "build_norm", "model_defaults", "seeded"]
