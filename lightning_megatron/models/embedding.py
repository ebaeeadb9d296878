"""Input embeddings of language models and the tied output projection to vocabulary logits."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel import context_parallel_position_ids
from ..parallel import get_parallel_state
from ..tensor_parallel.random import get_rng_tracker
from ..tensor_parallel import (
    VocabParallelEmbedding, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    init_method_normal,
)
from ..transformer import TransformerConfig, build_norm, seeded


def _replicated_embedding(config: TransformerConfig, rows: int, name: str) -> nn.Embedding:
    with seeded(config.init_seed, name):
        table = nn.Embedding(rows, config.hidden_size, dtype=config.params_dtype)
        init_method_normal(config.init_method_std)(table.weight.data)
    # under sequence parallelism each rank looks up only its slice of positions: partial grads
    table.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # runtime attribute
    return table


class LanguageModelEmbedding(nn.Module):
    """word (vocab-parallel) + learned position (+ token type) embeddings, returned ``[s, b, h]``.
    With ``position_embedding_type`` "rope" or "none" there is no position table.

    With sequence parallelism the word lookup is reduce-scattered along the sequence and each
    rank adds only its positions, so no rank ever holds the full ``[s, b, h]`` embedding. Under
    context parallelism ``input_ids`` is this rank's split and positions default to its tokens'
    global positions.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, padded_vocab_size: int,
                 max_sequence_length: int, num_tokentypes: int = 0, layernorm: bool = False) -> None:
        super().__init__()
        self.config = config
        self.max_sequence_length = max_sequence_length
        with seeded(config.init_seed, "word_embeddings"):
            self.word_embeddings = VocabParallelEmbedding(
                padded_vocab_size, config.hidden_size, init_method=init_method_normal(config.init_method_std),
                sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                vocab_size=vocab_size)
        # rotary (or no) position embeddings: positions enter in attention, no table here
        self.position_embeddings = (_replicated_embedding(config, max_sequence_length, "position_embeddings")
                                    if config.position_embedding_type == "learned" else None)
        self.tokentype_embeddings = (_replicated_embedding(config, num_tokentypes, "tokentype_embeddings")
                                     if num_tokentypes else None)
        self.norm = build_norm(config) if layernorm else None
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _local_slice(self, ids: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` ids → this rank's ``[s(/tp), b]`` slice."""
        ids = ids.t()
        if self.config.sequence_parallel:
            state = get_parallel_state()
            ids = ids.chunk(state.tp_size, dim=0)[state.tp_rank]
        return ids

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = input_ids.shape
        state = get_parallel_state()
        if self.position_embeddings is not None and s * state.cp_size > self.max_sequence_length:
            share = f" ({s} on each of {state.cp_size} context-parallel ranks)" if state.cp_size > 1 else ""
            raise ValueError(f"sequence length {s * state.cp_size}{share} exceeds max_sequence_length="
                             f"{self.max_sequence_length}; raise it when building the model or truncate the inputs.")
        hidden = self.word_embeddings(input_ids.t())                       # [s(/tp), b, h]
        if self.config.embedding_multiplier != 1.0:   # Gemma: sqrt(h), rounded to the activations' dtype first
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        if self.position_embeddings is not None:
            if position_ids is None:   # under context parallelism: the global positions of this rank's tokens
                position_ids = context_parallel_position_ids(s, state.cp_size, state.cp_rank, input_ids.device)
                position_ids = position_ids.expand(b, s)
            hidden = hidden + self.position_embeddings(self._local_slice(position_ids))
        if self.tokentype_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            hidden = hidden + self.tokentype_embeddings(self._local_slice(token_type_ids))
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.config.sequence_parallel and self.training:
            with get_rng_tracker().fork():   # each rank holds different tokens
                return self.dropout(hidden)
        return self.dropout(hidden)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool,
                    bias: Optional[torch.Tensor] = None,
                    matmul: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
    """``[s(/tp), b, h]`` hidden states times this rank's vocabulary rows → ``[s, b, V/tp]`` logits.

    The hidden states are replicated over tp (f) or, under sequence parallelism, all-gathered
    first; the logits stay vocab-parallel for ``vocab_parallel_cross_entropy``. ``matmul(hidden, weight,
    bias)``: the local projection (default ``F.linear``; a float8 one with ``Float8Config(output_layer=True)``).
    """
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        hidden = copy_to_tensor_parallel_region(hidden)
    return (matmul or F.linear)(hidden, weight, bias)


def output_weight_for_stage(config: TransformerConfig, vocab_size: int, padded_vocab_size: int,
                            tied: bool) -> nn.Parameter:
    """The output projection ``[V_padded/tp, h]`` of a last stage that holds no word embeddings.

    Tied (pipeline > 1): drawn from the word embeddings' seed, so it starts equal to the first
    stage's table, and tagged ``shared_embedding`` so the two gradients are summed over the
    embedding group after backward. Untied: its own seed.
    """
    with seeded(config.init_seed, "word_embeddings" if tied else "output_layer"):
        twin = VocabParallelEmbedding(padded_vocab_size, config.hidden_size,
                                      init_method=init_method_normal(config.init_method_std),
                                      params_dtype=config.params_dtype, vocab_size=vocab_size)
    weight = twin.weight
    weight.shared_embedding = tied  # type: ignore[attr-defined]  # runtime attribute
    return weight
