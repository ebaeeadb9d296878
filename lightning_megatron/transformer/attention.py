"""Self-attention with heads split over tensor-parallel ranks (seed 002, Figure 3b).

Q/K/V come from one column-parallel GEMM whose output rows are laid out head by head
(``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``), so a contiguous tp shard holds whole heads; the output
projection is row-parallel, so one all-reduce (or reduce-scatter under sequence parallelism)
per attention block. Activations are sequence-first, ``[s, b, h]``. Under context parallelism
``s`` is this rank's share of the sequence and ``context_parallel.py`` supplies the other keys.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import get_parallel_state
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_method_normal
from .config import HEADS_SPLIT, TransformerConfig, check_splits_over_tensor_parallel
from .context_parallel import context_parallel_attention, context_parallel_rng_fork


def attention_bias(attention_mask: Optional[torch.Tensor], causal: bool, seq_len: int,
                   device: torch.device) -> Optional[torch.Tensor]:
    """Boolean ``[b, 1, s, s]`` (or broadcastable) mask, True where attention is allowed.

    ``attention_mask`` is ``[b, s]`` with 1 for real tokens and 0 for padding (the Hugging Face
    convention); ``None`` with ``causal`` lets SDPA use its causal kernel directly.
    """
    if attention_mask is None:
        return None
    keep = attention_mask.to(torch.bool)[:, None, None, :]              # [b, 1, 1, s] over keys
    if causal:
        keep = keep & torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return keep


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        tp = get_parallel_state().tp_size
        self.config = config
        check_splits_over_tensor_parallel("num_attention_heads", config.num_attention_heads, tp, HEADS_SPLIT)
        self.heads_per_rank = config.num_attention_heads // tp
        self.head_dim = config.head_dim
        self.layer_number = layer_number
        self.qkv = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, bias=config.add_bias_linear,
            init_method=init_method_normal(config.init_method_std), sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype)
        self.proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True,
            init_method=init_method_normal(config.output_layer_init_std),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        mixed = self.qkv(hidden)                                            # [s, b, 3·h/tp]
        s, b = mixed.shape[0], mixed.shape[1]
        q, k, v = mixed.view(s, b, self.heads_per_rank, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        causal = self.config.attn_mask_type == "causal"
        dropout = self.config.attention_dropout if self.training else 0.0
        state = get_parallel_state()
        if state.cp_size > 1:   # s is this rank's share of the sequence: keys/values come from all cp ranks
            rng = context_parallel_rng_fork(state.rng_tracker, state.cp_rank) if dropout > 0 else None
            context = context_parallel_attention(q, k, v, attention_mask, causal, dropout, state.cp_group, rng)
        else:
            mask = attention_bias(attention_mask, causal, s, hidden.device)
            # each rank's heads are different heads: their dropout must differ (seed 002, B.2); under
            # sequence parallelism the whole block already runs on the tp-rank generator
            forked = dropout > 0 and not self.config.sequence_parallel
            with state.rng_tracker.fork() if forked else contextlib.nullcontext():
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                         is_causal=causal and mask is None)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.proj(context)
