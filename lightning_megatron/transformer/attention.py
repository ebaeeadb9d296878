"""Self-attention with heads split over tensor-parallel ranks (seed 002, Figure 3b).

Q/K/V come from one column-parallel GEMM whose output rows are laid out head by head
(``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``), so a contiguous tp shard holds whole heads; the output
projection is row-parallel, so one all-reduce (or reduce-scatter under sequence parallelism)
per attention block. Activations are sequence-first, ``[s, b, h]``. Under context parallelism
``s`` is this rank's share of the sequence and ``context_parallel.py`` supplies the other keys.

Grouped-query attention (``num_query_groups`` G < heads H) has two column-parallel weights: ``q``
(``[H·d, h]``, whole query heads per rank) and ``kv`` (``[2·G·d, h]``, rows ``[k_0 v_0 k_1 v_1 ...]``,
d rows each). When G divides by tp, a contiguous shard of ``kv`` is exactly the key/value heads of
this rank's query heads. When tp > G (tp a multiple of G), ``tp/G`` ranks share each key/value head
(Megatron replicates them): every rank still stores an equal 1/tp slice of ``kv`` (so the weight,
its optimizer state and checkpoints are laid out as in any tp), and the forward all-gathers the
``2·G·d·h`` weight over tp and uses its group's rows. The gather's backward is a reduce-scatter, so
the gradient of a shared head is the sum over the ranks using it: exact, with no extra reduction
step. Both projections read one copy of the input (one sequence-parallel all-gather).

Rotary embeddings (``position_embedding_type="rope"``) rotate queries and keys here, on the whole
(context-parallel local) sequence, at the tokens' global positions; see ``rotary.py``.

Without context parallelism every case goes through ``score_attention.variant_attention``: plain attention (with
or without a padding mask) to SDPA's fused kernels; packed rows (``document_ids [b, s]``: attention stays inside each
document), sliding windows (on this layer: ``config.window_of``; one longer than the sequence changes nothing),
attention soft-capping and a ``softmax_scale`` to the kernel ``config.document_attention`` chooses (FlexAttention on
CUDA, boolean-mask SDPA or float32 math elsewhere and with dropout).
Under context parallelism the window joins the causal masks of the gathered keys and the scale goes to the kernels;
soft-capping is refused there when the model is built.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import get_parallel_state
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_rng_tracker, init_method_normal
from ..tensor_parallel.column_backward import column_parallel_linears
from ..tensor_parallel.comm_overlap import all_gather_linear
from ..tensor_parallel.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region
from .config import HEADS_SPLIT, TransformerConfig, check_query_groups, check_splits_over_tensor_parallel
from .context_parallel import context_parallel_self_attention
from .documents import DocumentMask
from .norm import build_norm
from .qk_norm import AcrossHeadsRMSNorm, normalize_across_heads
from .rotary import RotaryEmbedding, apply_rotary
from .score_attention import variant_attention


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


def _local_linear(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    local = getattr(layer, "local_linear", None)
    return local(x, weight, bias) if local is not None else F.linear(x, weight, bias)


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        state = get_parallel_state()
        tp = state.tp_size
        self.config = config
        check_splits_over_tensor_parallel("num_attention_heads", config.num_attention_heads, tp, HEADS_SPLIT)
        check_query_groups(config, tp)
        self.heads_per_rank = config.num_attention_heads // tp
        self.head_dim = config.head_dim
        self.layer_number = layer_number
        width = config.num_attention_heads * config.head_dim
        column: Dict[str, Any] = dict(
            bias=config.qkv_bias, init_method=init_method_normal(config.init_method_std),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
            comm_overlap=config.tp_comm_overlap,
            grad_accumulation_fusion=config.gradient_accumulation_fusion)
        groups = config.query_groups
        if config.grouped_query_attention:
            self.q = ColumnParallelLinear(config.hidden_size, width, **column)
            self.kv = ColumnParallelLinear(config.hidden_size, 2 * groups * config.head_dim, **column)
            self.kv_heads_per_rank = max(groups // tp, 1)
            self.kv_sharing_ranks = tp // groups if tp > groups else 1   # ranks that use one key/value head
        else:
            self.qkv = ColumnParallelLinear(config.hidden_size, 3 * width, **column)
            self.kv_heads_per_rank, self.kv_sharing_ranks = self.heads_per_rank, 1
        self.proj = RowParallelLinear(
            width, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True,
            init_method=init_method_normal(config.output_layer_init_std),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
            comm_overlap=config.tp_comm_overlap,
            grad_accumulation_fusion=config.gradient_accumulation_fusion)
        self.window = config.window_of(layer_number)
        local_base = config.window_rotary_base if self.window is not None else None   # Gemma 3's local layers
        self.rotary = (RotaryEmbedding(config.rotary_dim, local_base or config.rotary_base,
                                       None if local_base else config.rope_scaling)
                       if config.position_embedding_type == "rope" else None)
        if config.attn_logit_softcapping is not None and state.cp_size > 1:
            raise ValueError(f"TransformerConfig.attn_logit_softcapping={config.attn_logit_softcapping} with "
                             f"context_parallel_size={state.cp_size}: soft-capped attention is not implemented under "
                             f"context parallelism; use context_parallel_size=1.")
        self.tp_rank = state.tp_rank
        self.q_norm: Optional[nn.Module] = None
        self.k_norm: Optional[nn.Module] = None
        if config.qk_layernorm and config.qk_layernorm_across_heads:   # OLMo-2: one norm over every head
            self.q_norm, self.k_norm = (
                AcrossHeadsRMSNorm(heads, config.head_dim, config.layernorm_epsilon, config.params_dtype,
                                   config.layernorm_zero_centered_gamma)
                for heads in (config.num_attention_heads, groups))
        elif config.qk_layernorm:   # over each head's channels; the weight is shared by all heads, so by all tp ranks
            self.q_norm, self.k_norm = build_norm(config, config.head_dim), build_norm(config, config.head_dim)
            for param in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                # each tp rank's heads give a partial gradient: summed over tp like sequence-parallel norms
                param.sequence_parallel = True  # type: ignore[attr-defined]  # runtime attribute

    def _one_column_linear(self) -> bool:
        """Whether queries and keys/values run as column-parallel linears on one gathered input (tp > 1, no float8,
        no deferred weight gradients): their input gradient's one collective then runs while their weight gradients
        are computed (``column_backward.py``), as in every other column-parallel linear."""
        return self.q._backward_overlapped() and self.kv._backward_overlapped()

    def _project(self, hidden: torch.Tensor):
        """``q [b, heads/tp, s, d]``, ``k``/``v`` ``[b, kv heads of this rank, s, d]``."""
        if not self.config.grouped_query_attention:
            mixed = self.qkv(hidden)                                            # [s, b, 3·h/tp]
            s, b = mixed.shape[0], mixed.shape[1]
            return mixed.view(s, b, self.heads_per_rank, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        group = self.q.group
        weight: torch.Tensor = self.kv.weight
        bias: Optional[torch.Tensor] = self.kv.bias
        if self.kv_sharing_ranks > 1:   # all-gather the small kv weight, keep this rank's group (see the docstring)
            rows = 2 * self.head_dim
            first = self.q.tp_rank // self.kv_sharing_ranks * rows
            weight = gather_from_sequence_parallel_region(weight, group)[first:first + rows]
            if bias is not None:
                bias = gather_from_sequence_parallel_region(bias, group)[first:first + rows]
        if self.q._overlapped():   # one overlapped gather-and-matmul for queries, keys and values
            both = None if bias is None or self.q.bias is None else torch.cat([self.q.bias, bias])
            mixed = all_gather_linear(hidden, torch.cat([self.q.weight, weight]), both, group)
            q, kv = mixed.split([self.q.weight.shape[0], weight.shape[0]], dim=-1)
        elif self._one_column_linear():
            # gradient-accumulation fusion into each parameter (not through a gathered, shared kv weight)
            into = (self.q.weight if self.q.accumulate_weight_grads else None,
                    weight if self.kv.accumulate_weight_grads and weight is self.kv.weight else None)
            q, kv = column_parallel_linears(hidden, (self.q.weight, weight), (self.q.bias, bias), group,
                                            self.q.sequence_parallel, into)
        else:
            if self.q.sequence_parallel:
                x = gather_from_sequence_parallel_region(hidden, group, tensor_parallel_output_grad=True)
            else:
                x = copy_to_tensor_parallel_region(hidden, group)
            # the layers' own matmul (F.linear, or float8 where enabled) on the shared input copy
            q = _local_linear(self.q, x, self.q.weight, self.q.bias)
            kv = _local_linear(self.kv, x, weight, bias)
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)
        k, v = kv.view(s, b, self.kv_heads_per_rank, 2, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        return q, k, v

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                document_ids: Union[torch.Tensor, DocumentMask, None] = None) -> torch.Tensor:
        """``position_ids [b, s]``: the tokens' positions for rotary embeddings (this cp rank's slice);
        default: their global positions. ``document_ids [b, s]`` (this cp rank's slice, or the block's
        ``DocumentMask`` of them): packed documents, which attention does not cross."""
        q, k, v = self._project(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._normalize_queries_and_keys(q, k)
        b, s = q.shape[0], q.shape[2]
        documents = None if document_ids is None else DocumentMask.of(document_ids)
        if documents is not None:   # before any collective: a wrong shape is the caller's, on every rank
            documents.check(b, s)
        if self.rotary is not None:
            cos, sin = self.rotary(s, q.device, q.dtype, position_ids)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        causal = self.config.attn_mask_type == "causal"
        dropout = self.config.attention_dropout if self.training else 0.0
        state = get_parallel_state()
        window = self.window if self.window is not None and s * state.cp_size > self.window else None
        if window is not None and not causal:
            raise ValueError(f"TransformerConfig.sliding_window={window} with attn_mask_type="
                             f"{self.config.attn_mask_type!r}: "
                             f"sliding windows here are causal; use attn_mask_type='causal' or sliding_window=None.")
        scale, softcap = self.config.softmax_scale, self.config.attn_logit_softcapping
        if state.cp_size > 1:   # s is this rank's share of the sequence: keys/values come from all cp ranks
            context = context_parallel_self_attention(q, k, v, attention_mask, causal, dropout, documents, window,
                                                      scale)
        else:
            # each rank's heads are different heads: their dropout must differ (seed 002, B.2); under
            # sequence parallelism the whole block already runs on the tp-rank generator
            forked = dropout > 0 and not self.config.sequence_parallel
            with get_rng_tracker(state).fork() if forked else contextlib.nullcontext():
                # one entry for every variant: plain attention (no window, cap, scale or documents) takes SDPA's
                # fused kernels through the mask path whatever kernel packed documents are set to
                plain = window is None and scale is None and softcap is None and documents is None
                context = variant_attention(q, k, v, causal=causal, dropout_p=dropout, scale=scale, softcap=softcap,
                                            window=window, attention_mask=attention_mask, documents=documents,
                                            kernel="mask" if plain else self.config.document_attention)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.proj(context)

    def _normalize_queries_and_keys(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        assert self.q_norm is not None and self.k_norm is not None   # the caller checked
        if not isinstance(self.q_norm, AcrossHeadsRMSNorm) or not isinstance(self.k_norm, AcrossHeadsRMSNorm):
            return self.q_norm(q), self.k_norm(k)
        group = get_parallel_state().tp_group
        k_first = (self.tp_rank // self.kv_sharing_ranks if self.kv_sharing_ranks > 1
                   else self.tp_rank * self.kv_heads_per_rank)
        q, k = normalize_across_heads([(self.q_norm, q, self.tp_rank * self.heads_per_rank, 1),
                                       (self.k_norm, k, k_first, self.kv_sharing_ranks)], group)
        return q, k
