"""Model FLOPs of one training step from a ``TransformerConfig`` (for TFLOP/s and MFU in the logs).

Counted the way Megatron-LM counts them (Narayanan et al. 2021, appendix "Floating-point operations"):
only matrix multiplications, 2 FLOPs per multiply-add, and training = 3 x forward (the backward pass
computes a data gradient and a weight gradient for every GEMM). These are *model* FLOPs: activation
recomputation, padded vocabulary rows and the tensor/pipeline layout add work but not model FLOPs, so
the number is the same for every parallel layout and MFU compares layouts fairly.

Per token and layer, forward (``h`` hidden, ``f`` FFN hidden, ``s`` sequence length):

- attention: QKV ``6h^2`` + output projection ``2h^2`` + scores ``QK^T`` and ``AV`` ``4sh``
  (halved for causal attention: only the lower triangle is needed, as Megatron-LM counts it); with
  ``num_query_groups`` G (grouped-query attention) K and V take ``4h·G·d`` instead of ``4h^2``, and
  with ``kv_channels`` d the query width is heads x d instead of ``h``;
- dense MLP: ``4hf``, or ``6hf`` for a gated MLP (SwiGLU: gate and up projections);
- mixture of experts: router ``2hE`` + ``topk`` routed experts' MLP + the shared expert's MLP;
- once per token: the output-layer logits ``2hV`` when ``vocab_size`` is given.

Pure Python on integers: no torch.distributed, no Lightning.
"""

from __future__ import annotations

from typing import Optional

from .config import GATED_ACTIVATIONS, TransformerConfig

__all__ = ["forward_flops_per_sequence", "layer_forward_flops", "linear_training_flops", "mlp_width",
           "training_flops_per_sequence", "training_flops_per_token"]


def _mlp_forward_flops(hidden_size: int, ffn_hidden_size: int, activation: str) -> int:
    """Per token: fc1 (two projections when gated) and fc2."""
    projections_in = 2 if activation in GATED_ACTIVATIONS else 1
    return 2 * hidden_size * ffn_hidden_size * (projections_in + 1)


def mlp_width(config: TransformerConfig, layer_number: int) -> int:
    """Hidden units a token activates in layer ``layer_number``'s MLP: the FFN, or its routed and shared experts."""
    if not config.is_moe_layer(layer_number):
        assert config.ffn_hidden_size is not None   # TransformerConfig.__post_init__ filled it
        return config.ffn_hidden_size
    moe = config.moe
    assert moe is not None   # config.is_moe_layer
    return moe.topk * moe.ffn_hidden_size + (moe.shared_expert_ffn_hidden_size or 0)


def layer_forward_flops(config: TransformerConfig, layer_number: int, seq_length: int,
                        *, causal: Optional[bool] = None) -> int:
    """Matmul FLOPs of layer ``layer_number``'s (1-based) forward over one sequence of ``seq_length`` tokens."""
    h, s = config.hidden_size, seq_length
    if causal is None:
        causal = config.attn_mask_type == "causal"
    width = config.num_attention_heads * config.head_dim                  # query heads x head size (h by default)
    kv_width = getattr(config, "query_groups", config.num_attention_heads) * config.head_dim   # fewer under GQA
    # Q, K, V and output projections over s tokens, then QK^T and AV over s x s (or half of it)
    attention = 2 * h * (2 * width + 2 * kv_width) * s + (2 if causal else 4) * width * s * s
    if not config.is_moe_layer(layer_number):
        assert config.ffn_hidden_size is not None   # TransformerConfig.__post_init__ filled it
        return attention + s * _mlp_forward_flops(h, config.ffn_hidden_size, config.activation)
    moe = config.moe
    assert moe is not None   # config.is_moe_layer
    routed = moe.topk * _mlp_forward_flops(h, moe.ffn_hidden_size, moe.activation)
    shared = (_mlp_forward_flops(h, moe.shared_expert_ffn_hidden_size, moe.activation)
              if moe.shared_expert_ffn_hidden_size else 0)
    return attention + s * (2 * h * moe.num_experts + routed + shared)


def forward_flops_per_sequence(config: TransformerConfig, seq_length: int, vocab_size: Optional[int] = None,
                               *, causal: Optional[bool] = None) -> int:
    """Matmul FLOPs of one forward pass over one sequence of ``seq_length`` tokens.

    ``vocab_size``: count the logits GEMM over every position (language models; the real vocabulary,
    not the tensor-parallel padded one); ``None`` for encoders whose small heads the caller adds.
    ``causal``: count half the attention score matrix; default from ``config.attn_mask_type``.
    """
    for name, value in (("seq_length", seq_length), ("vocab_size", 1 if vocab_size is None else vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    layers = sum(layer_forward_flops(config, number, seq_length, causal=causal)
                 for number in range(1, config.num_layers + 1))
    return layers + (seq_length * 2 * config.hidden_size * vocab_size if vocab_size is not None else 0)


def training_flops_per_sequence(config: TransformerConfig, seq_length: int, vocab_size: Optional[int] = None,
                                *, causal: Optional[bool] = None) -> int:
    """Forward + backward matmul FLOPs for one sequence: 3 x :func:`forward_flops_per_sequence`."""
    return 3 * forward_flops_per_sequence(config, seq_length, vocab_size, causal=causal)


def training_flops_per_token(config: TransformerConfig, seq_length: int, vocab_size: Optional[int] = None,
                             *, causal: Optional[bool] = None) -> float:
    """:func:`training_flops_per_sequence` / ``seq_length`` (the attention term grows with the length)."""
    return training_flops_per_sequence(config, seq_length, vocab_size, causal=causal) / seq_length


def linear_training_flops(in_features: int, out_features: int, rows: int = 1) -> int:
    """Forward + backward FLOPs of a ``Linear(in_features, out_features)`` applied to ``rows`` vectors
    (task heads: a pooler, a classifier)."""
    return 3 * 2 * in_features * out_features * rows
