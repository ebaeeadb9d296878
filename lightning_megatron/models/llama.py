"""Llama-family language models (Llama 2/3, Mistral, Mixtral) from the GPT blocks.

A Llama is a ``GPTModel`` whose configuration says so: rotary position embeddings instead of a
learned table, grouped-query attention (``num_query_groups``), SwiGLU MLPs, RMSNorm, no biases and
an output layer of its own (untied from the word embeddings). Mixtral swaps every MLP for a
mixture of experts (top-2 of 8 by default: softmax over the chosen experts' logits, which equals
Hugging Face's softmax over all of them renormalised over the top k), dropless.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..transformer import TransformerConfig
from .gpt import GPTModel

LLAMA_DEFAULTS: Dict[str, Any] = dict(
    activation="swiglu", normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
    hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5, layernorm_order="pre",
    attn_mask_type="causal",
)


def llama_config(num_layers: int, hidden_size: int, num_attention_heads: int,
                 num_query_groups: Optional[int] = None, ffn_hidden_size: Optional[int] = None,
                 rotary_base: float = 10000.0, rope_scaling: Optional[Dict[str, Any]] = None,
                 **overrides: Any) -> TransformerConfig:
    """A Llama ``TransformerConfig``; ``overrides`` are any other ``TransformerConfig`` fields.

    ``ffn_hidden_size`` defaults to Llama's ``256·ceil(8h/3 / 256)``.
    """
    if ffn_hidden_size is None:
        ffn_hidden_size = 256 * -(-int(8 * hidden_size / 3) // 256)
    fields = dict(LLAMA_DEFAULTS, num_layers=num_layers, hidden_size=hidden_size,
                  num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                  ffn_hidden_size=ffn_hidden_size, rotary_base=rotary_base, rope_scaling=rope_scaling)
    fields.update(overrides)
    return TransformerConfig(**fields)


def mixtral_config(num_layers: int, hidden_size: int, num_attention_heads: int, ffn_hidden_size: int,
                   num_query_groups: Optional[int] = None, num_experts: int = 8, topk: int = 2,
                   rotary_base: float = 1e6, moe_overrides: Optional[Dict[str, Any]] = None,
                   **overrides: Any) -> TransformerConfig:
    """A Mixtral ``TransformerConfig``: a Llama whose every MLP is a dropless mixture of
    ``num_experts`` SwiGLU experts of ``ffn_hidden_size`` with top-``topk`` softmax routing.
    ``moe_overrides``: ``MoEConfig`` fields (dispatcher, aux_loss_coeff, ...)."""
    from ..moe import MoEConfig

    moe = MoEConfig(**dict(dict(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_experts=num_experts,
                                topk=topk, activation="swiglu", score_function="softmax", pre_softmax=False,
                                capacity_factor=None), **(moe_overrides or {})))
    return llama_config(num_layers, hidden_size, num_attention_heads, num_query_groups=num_query_groups,
                        ffn_hidden_size=ffn_hidden_size, rotary_base=rotary_base,
                        **dict(dict(moe=moe, moe_layer_freq=1), **overrides))


class LlamaModel(GPTModel):
    """A ``GPTModel`` with a Llama configuration (``llama_config`` / ``mixtral_config`` /
    ``hf_llama.config_from_hf``) and, by default, its own output layer.

    ``forward(input_ids, position_ids=None, attention_mask=None, labels=None, document_ids=None)`` as
    ``GPTModel``; ``position_ids`` (this context-parallel rank's slice) only change the rotary angles,
    ``document_ids`` (packed rows) keep attention inside each document.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, vp_rank: int = 0,
                 tie_word_embeddings: bool = False, **kwargs: Any) -> None:
        if config.position_embedding_type != "rope":
            raise ValueError(f"LlamaModel needs TransformerConfig(position_embedding_type='rope'), got "
                             f"{config.position_embedding_type!r}; build the config with llama_config(...).")
        super().__init__(config, vocab_size, max_sequence_length, vp_rank=vp_rank,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
