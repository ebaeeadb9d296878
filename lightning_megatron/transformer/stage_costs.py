"""What each piece of a transformer language model costs to train, for balancing pipeline stages.

Per sequence of ``seq_length`` tokens, in FLOPs: a layer's matrix multiplications three times (forward,
data gradient, weight gradient; four with ``recompute_layers``) as ``transformer.flops`` counts them,
dense and mixture-of-experts layers each their own; the output layer's GEMM likewise; and the work bound
by memory rather than arithmetic as its bytes at ``FLOPS_PER_BYTE``: a layer's element-wise passes (norms,
residual adds, rotary, attention inputs and outputs: about 24 ``h``-wide 16-bit rows per token forward and
backward, and 6 ``ffn``-wide ones for the activation), the embedding's gather and scatter-add (4 rows),
and the loss's passes over the ``[tokens, V]`` logits (written by the GEMM, statistics, gradient, read
back: 4). The element-wise terms are what keep tiny models (``h`` of a few dozen, where they dominate)
from being split as if only the vocabulary mattered; at ``h >= 1024`` they are about a tenth of a layer.

A 1B Llama (h 2048, FFN 8192, 8 KV groups, sequence 4096, vocabulary 128256) counts its output layer and
loss as 3.9 layers and the embedding as 0.02 (measured on an H200 before the fused loss: 4.3 layers).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from .config import TransformerConfig
from .flops import _mlp_forward_flops

__all__ = ["FLOPS_PER_BYTE", "ModelCosts", "language_model_costs"]

# bf16 dense peak (~790 TFLOP/s measured) over HBM bandwidth (3.35 TB/s H100, 4.8 TB/s H200)
FLOPS_PER_BYTE = 200
_LOGITS_PASSES = 4          # GEMM writes, statistics pass reads, gradient pass reads and writes (16-bit)
_EMBEDDING_PASSES = 4       # gather reads and writes; backward reads the gradient and adds into the table
_LAYER_HIDDEN_PASSES = 24   # h-wide rows per token, forward and backward: norms, residuals, rotary, attention I/O
_LAYER_FFN_PASSES = 6       # ffn-wide rows: the activation (gated: two inputs) forward and backward


class ModelCosts(NamedTuple):
    """Training cost of every layer, of the embedding (first chunk) and of the head (last chunk)."""

    layers: List[int]
    embedding: int
    head: int


def _layer_forward_flops(config: TransformerConfig, layer_number: int, seq_length: int) -> Tuple[int, int]:
    """Matmul FLOPs of one layer's forward over one sequence and its MLP's activated width (``layer_number``
    1-based, as ``TransformerLayer`` numbers them: dense or mixture of experts follows ``moe_layer_freq``)."""
    h, s = config.hidden_size, seq_length
    width = config.num_attention_heads * config.head_dim
    kv_width = getattr(config, "query_groups", config.num_attention_heads) * config.head_dim
    causal = config.attn_mask_type == "causal"
    attention = 2 * h * (2 * width + 2 * kv_width) * s + (2 if causal else 4) * width * s * s
    is_moe = config.moe is not None and (layer_number - 1) % config.moe_layer_freq == 0
    if not is_moe:
        assert config.ffn_hidden_size is not None   # TransformerConfig.__post_init__ filled it
        return (attention + s * _mlp_forward_flops(h, config.ffn_hidden_size, config.activation),
                config.ffn_hidden_size)
    moe = config.moe
    assert moe is not None
    routed = moe.topk * _mlp_forward_flops(h, moe.ffn_hidden_size, moe.activation)
    shared = (_mlp_forward_flops(h, moe.shared_expert_ffn_hidden_size, moe.activation)
              if moe.shared_expert_ffn_hidden_size else 0)
    return (attention + s * (2 * h * moe.num_experts + routed + shared),
            moe.topk * moe.ffn_hidden_size + (moe.shared_expert_ffn_hidden_size or 0))


def language_model_costs(config: TransformerConfig, seq_length: int, vocab_size: Optional[int],
                         head_flops_per_token: int = 0, recompute_output_layer: bool = False) -> ModelCosts:
    """Costs of a language model's pieces per training sequence.

    ``vocab_size``: the output layer and loss on the last chunk (None: no vocabulary-wide head, e.g. a
    classifier); ``head_flops_per_token``: other forward matmul FLOPs of the head per token (a BERT
    masked-LM transform); ``recompute_output_layer``: the loss fused in chunks runs the output GEMM again
    in the backward.
    """
    passes = 4 if config.recompute_layers else 3
    h, s = config.hidden_size, seq_length
    layers = []
    for number in range(1, config.num_layers + 1):
        flops, ffn = _layer_forward_flops(config, number, s)
        memory = 2 * (_LAYER_HIDDEN_PASSES * h + _LAYER_FFN_PASSES * ffn) * s
        layers.append(passes * flops + FLOPS_PER_BYTE * memory)
    head = 3 * head_flops_per_token * s
    if vocab_size is not None:
        head += (4 if recompute_output_layer else 3) * 2 * h * vocab_size * s
        head += FLOPS_PER_BYTE * _LOGITS_PASSES * 2 * vocab_size * s
    embedding = FLOPS_PER_BYTE * _EMBEDDING_PASSES * 2 * h * s
    return ModelCosts(layers, embedding, head)
