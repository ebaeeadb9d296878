"""BERT: word/position/token-type embeddings, a padding-masked encoder, pooler and task heads.

``layernorm_order="post"`` is the original BERT (and Hugging Face) layer with a norm after the
embeddings; ``"pre"`` is Megatron's reordered layer (seed 002, Figure 7b) with a final norm
instead, which the paper shows is what lets BERT scale past 336M parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel import context_parallel_first_token
from ..parallel import chunk_position, get_parallel_state
from ..tensor_parallel import (
    gather_from_sequence_parallel_region, init_method_normal, pad_vocab_size, vocab_parallel_cross_entropy,
)
from ..tensor_parallel.utils import set_tensor_model_parallel_attributes
from ..transformer.config import with_strategy_defaults
from ..transformer import TransformerBlock, TransformerConfig, build_norm, seeded
from ..transformer.stage_costs import language_model_costs
from .embedding import LanguageModelEmbedding, output_weight_for_stage, parallel_logits
from .pipeline_layout import PipelineLayout, resolve_pipeline_layout


def _replicated_linear(config: TransformerConfig, name: str, in_features: int, out_features: int) -> nn.Linear:
    """A small layer every tp rank holds whole (pooler, heads), initialised from its own seed."""
    with seeded(config.init_seed, name):
        layer = nn.Linear(in_features, out_features, dtype=config.params_dtype)
        init_method_normal(config.init_method_std)(layer.weight.data)
        nn.init.zeros_(layer.bias)
    return layer


class BertOutput(NamedTuple):
    hidden_states: torch.Tensor            # [b, s, h]
    pooled: Optional[torch.Tensor]         # [b, h], tanh(W · hidden[:, 0]) or None without pooler


class BertModel(nn.Module):
    """One pipeline chunk of a BERT encoder; on the last chunk returns ``BertOutput``.

    ``forward(input_ids [b, s], attention_mask [b, s] (1 = token, 0 = padding), token_type_ids)``.
    Earlier chunks return ``[s, b, h]`` for the next stage and later ones read
    ``set_input_tensor``. Under context parallelism the inputs and ``hidden_states`` are this
    rank's ``split_for_context_parallel`` slice; ``pooled`` is the whole sequence's, on every cp rank.
    ``pipeline_layout`` as ``GPTModel``'s (balanced by default; ``BertForMaskedLM`` counts its head).
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_position_embeddings: int = 512,
                 type_vocab_size: int = 2, add_pooler: bool = True, vp_rank: int = 0,
                 pipeline_layout: PipelineLayout = None) -> None:
        super().__init__()
        if config.attn_mask_type != "padding":
            raise ValueError("BertModel is bidirectional: use TransformerConfig(attn_mask_type='padding').")
        config = with_strategy_defaults(config)
        self.config = config
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, get_parallel_state().tp_size)
        self.max_position_embeddings, self.type_vocab_size = max_position_embeddings, type_vocab_size
        self.pre_process, self.post_process = chunk_position(vp_rank)
        self.input_tensor: Optional[torch.Tensor] = None
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, self.padded_vocab_size, max_position_embeddings,
                num_tokentypes=type_vocab_size, layernorm=config.layernorm_order == "post")
        self.pipeline_layout: Tuple[int, ...] = resolve_pipeline_layout(
            pipeline_layout, config.num_layers, lambda: language_model_costs(config, max_position_embeddings, None))
        self.encoder = TransformerBlock(config, vp_rank, pipeline_layout=self.pipeline_layout)
        self.pooler = (_replicated_linear(config, "pooler", config.hidden_size, config.hidden_size)
                       if self.post_process and add_pooler else None)

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def word_embeddings_weight(self) -> Optional[torch.Tensor]:
        return self.embedding.word_embeddings.weight if self.pre_process else None

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None):
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids, token_type_ids)
        else:
            hidden = self.input_tensor
        hidden = self.encoder(hidden, attention_mask)
        if not self.post_process:
            return hidden
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        hidden = hidden.transpose(0, 1)                                     # [b, s, h]
        pooled = None
        if self.pooler is not None:   # [CLS] is global position 0: on cp rank 0, broadcast over cp
            pooled = torch.tanh(self.pooler(context_parallel_first_token(hidden)))
        return BertOutput(hidden, pooled)


class BertLMHead(nn.Module):
    """Masked-LM transform (dense + gelu + norm) and logits against the tied word embeddings."""

    def __init__(self, config: TransformerConfig, padded_vocab_size: int) -> None:
        super().__init__()
        self.dense = _replicated_linear(config, "lm_head.dense", config.hidden_size, config.hidden_size)
        self.norm = build_norm(config)
        for param in self.norm.parameters():
            # the head runs on gathered, replicated hidden states
            param.sequence_parallel = False  # type: ignore[attr-defined]  # runtime attribute
        self.bias = nn.Parameter(torch.zeros(padded_vocab_size // get_parallel_state().tp_size,
                                             dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, hidden_states: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` → vocab-parallel logits ``[b, s, V_padded/tp]``."""
        h = self.norm(F.gelu(self.dense(hidden_states)))
        return parallel_logits(h, word_embeddings, sequence_parallel=False, bias=self.bias)


class BertForMaskedLM(nn.Module):
    """BERT + masked-LM head; with ``labels`` (-100 = not masked) returns the per-token loss."""

    # the last stage's copy of the tied table is this weight in the single-process model
    tied_weights = {"output_weight": "bert.embedding.word_embeddings.weight"}

    def __init__(self, config: TransformerConfig, vocab_size: int, **bert_kwargs: Any) -> None:
        super().__init__()
        if bert_kwargs.get("pipeline_layout") in (None, "balanced"):   # the last stage runs the masked-LM head
            sequence = bert_kwargs.get("max_position_embeddings", 512)
            bert_kwargs["pipeline_layout"] = resolve_pipeline_layout(
                "balanced", config.num_layers, lambda: language_model_costs(
                    config, sequence, vocab_size, head_flops_per_token=2 * config.hidden_size ** 2))
        self.bert = BertModel(config, vocab_size, add_pooler=False, **bert_kwargs)
        self.lm_head = BertLMHead(config, self.bert.padded_vocab_size) if self.bert.post_process else None
        if self.lm_head is not None:
            # rows past it are tp-dependent padding
            self.lm_head.bias.vocab_size = vocab_size  # type: ignore[attr-defined]  # runtime attribute
        # the last stage's copy of the tied table when the pipeline puts it on another stage
        self.output_weight = (output_weight_for_stage(config, vocab_size, self.bert.padded_vocab_size, tied=True)
                              if self.bert.post_process and not self.bert.pre_process else None)
        if self.bert.pre_process and not self.bert.post_process:
            table = self.bert.word_embeddings_weight()
            assert table is not None   # the first stage holds the embedding
            table.shared_embedding = True  # type: ignore[attr-defined]  # runtime attribute

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.bert.set_input_tensor(tensor)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None):
        out = self.bert(input_ids, attention_mask, token_type_ids)
        if not self.bert.post_process:
            return out
        weight = self.output_weight if self.output_weight is not None else self.bert.word_embeddings_weight()
        assert self.lm_head is not None   # built on the last stage (post_process)
        logits = self.lm_head(out.hidden_states, weight)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, vocab_size=self.bert.vocab_size)


class BertForSequenceClassification(nn.Module):
    """BERT + dropout + linear on the pooled ``[CLS]`` state (MNLI: 3 labels)."""

    def __init__(self, config: TransformerConfig, vocab_size: int, num_labels: int, **bert_kwargs) -> None:
        super().__init__()
        self.bert = BertModel(config, vocab_size, **bert_kwargs)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.classifier = (_replicated_linear(config, "classifier", config.hidden_size, num_labels)
                           if self.bert.post_process else None)

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.bert.set_input_tensor(tensor)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        if not self.bert.post_process:
            return out
        assert self.classifier is not None   # built on the last stage (post_process)
        return self.classifier(self.dropout(out.pooled))                   # [b, num_labels]


class BertForMultipleChoice(nn.Module):
    """Scores ``[b, choices, s]`` inputs as ``b·choices`` sequences; returns ``[b, choices]`` (RACE)."""

    def __init__(self, config: TransformerConfig, vocab_size: int, **bert_kwargs) -> None:
        super().__init__()
        self.bert = BertModel(config, vocab_size, **bert_kwargs)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.classifier = (_replicated_linear(config, "classifier", config.hidden_size, 1)
                           if self.bert.post_process else None)

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.bert.set_input_tensor(tensor)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, choices, s = input_ids.shape
        flat = lambda t: None if t is None else t.reshape(b * choices, s)
        out = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids))
        if not self.bert.post_process:
            return out
        assert self.classifier is not None   # built on the last stage (post_process)
        return self.classifier(self.dropout(out.pooled)).view(b, choices)
