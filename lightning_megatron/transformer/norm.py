"""LayerNorm / RMSNorm, tagged so their gradients are summed over tp under sequence parallelism."""

from __future__ import annotations

from torch import nn

from .config import TransformerConfig


def build_norm(config: TransformerConfig, hidden_size: int | None = None) -> nn.Module:
    size = hidden_size or config.hidden_size
    norm: nn.Module
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    else:
        norm = nn.LayerNorm(size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    if config.sequence_parallel:
        # each tp rank normalises its own slice of the sequence: its grads are partial sums
        for param in norm.parameters():
            param.sequence_parallel = True  # type: ignore[attr-defined]  # runtime attribute
    return norm
