"""The shape of a transformer and how it is initialised, checked once, with errors that say the fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
LAYERNORM_ORDERS = ("pre", "post")
MASK_TYPES = ("causal", "padding")


@dataclass
class TransformerConfig:
    """Hyper-parameters of a transformer stack.

    ``layernorm_order="pre"`` is Megatron's reordered layer (seed 002, Figure 7b: norm before
    attention/MLP, residual around, a final norm) which trains stably at scale; ``"post"`` is the
    original BERT layer (residual, then norm). ``init_seed`` makes initialisation a function of
    the global layer index, so every parallel layout builds the same model.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None          # default 4 * hidden_size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "gelu"                       # gelu | gelu_tanh | swiglu
    normalization: str = "LayerNorm"               # LayerNorm | RMSNorm
    layernorm_epsilon: float = 1e-5
    layernorm_order: str = "pre"                   # pre | post
    attn_mask_type: str = "causal"                 # causal | padding
    add_bias_linear: bool = True
    init_method_std: float = 0.02
    scale_output_layer_init: bool = True           # std / sqrt(2 * num_layers) for residual writers
    init_seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    recompute_layers: bool = False                 # activation checkpointing per layer
    moe: Optional[Any] = None                      # a moe.MoEConfig: MLPs become mixture-of-experts layers
    moe_layer_freq: int = 1                        # every k-th layer (1-based: layers 1, 1+k, ...) is MoE

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}.")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size < 1:
            raise ValueError(f"TransformerConfig.ffn_hidden_size must be positive, got {self.ffn_hidden_size}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TransformerConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; each head needs an equal share."
            )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"TransformerConfig.{name} must be in [0, 1), got {value}.")
        for name, allowed in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS),
                              ("layernorm_order", LAYERNORM_ORDERS), ("attn_mask_type", MASK_TYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"TransformerConfig.{name}={getattr(self, name)!r} is not one of {list(allowed)}.")
        if self.init_method_std <= 0:
            raise ValueError(f"TransformerConfig.init_method_std must be positive, got {self.init_method_std}.")
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"TransformerConfig.moe.hidden_size={self.moe.hidden_size} must equal "
                             f"hidden_size={self.hidden_size}.")
        if self.moe_layer_freq < 1:
            raise ValueError(f"TransformerConfig.moe_layer_freq must be >= 1, got {self.moe_layer_freq}.")
        if not self.params_dtype.is_floating_point:
            raise ValueError(f"TransformerConfig.params_dtype must be a floating dtype, got {self.params_dtype}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def output_layer_init_std(self) -> float:
        """Std of layers writing into the residual stream (attention output, MLP fc2)."""
        if self.scale_output_layer_init:
            return self.init_method_std / (2.0 * self.num_layers) ** 0.5
        return self.init_method_std


def with_strategy_defaults(config: TransformerConfig) -> TransformerConfig:
    """``config`` with the strategy's ``sequence_parallel=True`` applied, if the strategy asked for it.

    Users set sequence parallelism once, on ``MegatronStrategy``; every model built under it follows.
    """
    from ..parallel import get_parallel_state, has_parallel_state

    if has_parallel_state() and get_parallel_state().sequence_parallel and not config.sequence_parallel:
        return dataclasses.replace(config, sequence_parallel=True)
    return config
