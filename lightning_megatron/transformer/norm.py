"""LayerNorm / RMSNorm, tagged so their gradients are summed over tp under sequence parallelism.

With ``layernorm_zero_centered_gamma`` (Gemma; Megatron-Core's option of that name) the weight is stored
centred on zero and the norm scales by ``1 + weight``, computed in float32 and cast back, as transformers'
``GemmaRMSNorm`` does, so imported weights load unchanged and train the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TransformerConfig


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """``rms_norm(x) * (1 + weight)`` in float32, weight initialised to 0 (the identity scale)."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None   # built with elementwise_affine
        out = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class ZeroCenteredLayerNorm(nn.LayerNorm):
    """``layer_norm(x) * (1 + weight) + bias`` in float32, weight initialised to 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None   # built with elementwise_affine
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, 1.0 + self.weight.float(), bias, self.eps).type_as(x)


def build_norm(config: TransformerConfig, hidden_size: int | None = None) -> nn.Module:
    size = hidden_size or config.hidden_size
    norm: nn.Module
    centred = config.layernorm_zero_centered_gamma
    if config.normalization == "RMSNorm":
        norm = (ZeroCenteredRMSNorm if centred else nn.RMSNorm)(size, eps=config.layernorm_epsilon,
                                                               dtype=config.params_dtype)
    else:
        norm = (ZeroCenteredLayerNorm if centred else nn.LayerNorm)(size, eps=config.layernorm_epsilon,
                                                                   dtype=config.params_dtype)
    if config.sequence_parallel:
        # each tp rank normalises its own slice of the sequence: its grads are partial sums
        for param in norm.parameters():
            param.sequence_parallel = True  # type: ignore[attr-defined]  # runtime attribute
    return norm
