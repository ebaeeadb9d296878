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

from typing import List, NamedTuple, Optional

from .config import TransformerConfig
from .flops import layer_forward_flops, mlp_width

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
        memory = 2 * (_LAYER_HIDDEN_PASSES * h + _LAYER_FFN_PASSES * mlp_width(config, number)) * s
        layers.append(passes * layer_forward_flops(config, number, s) + FLOPS_PER_BYTE * memory)
    head = 3 * head_flops_per_token * s
    if vocab_size is not None:
        head += (4 if recompute_output_layer else 3) * 2 * h * vocab_size * s
        head += FLOPS_PER_BYTE * _LOGITS_PASSES * 2 * vocab_size * s
    embedding = FLOPS_PER_BYTE * _EMBEDDING_PASSES * 2 * h * s
    return ModelCosts(layers, embedding, head)
