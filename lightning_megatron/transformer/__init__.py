"""Pipeline-aware transformer blocks built from the tensor-parallel layers."""

from .attention import SelfAttention, attention_bias
from .block import TransformerBlock
from .config import TransformerConfig, model_defaults
from .init import seeded
from .layer import TransformerLayer
from .mlp import MLP
from .norm import build_norm
from .rotary import RotaryEmbedding, apply_rotary, rope_inverse_frequencies

__all__ = ["MLP", "RotaryEmbedding", "SelfAttention", "TransformerBlock", "TransformerConfig", "TransformerLayer",
           "apply_rotary", "attention_bias", "build_norm", "model_defaults", "rope_inverse_frequencies", "seeded"]
