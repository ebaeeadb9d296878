"""Self-attention when the sequence is split over the context-parallel (cp) ranks.

Each cp rank holds the load-balanced slice of the sequence (chunks ``r`` and ``2cp-1-r``, see
``lightning_megatron.context_parallel.split``) for its tp shard of the heads. Keys and values are
exchanged by one ALL-GATHER over cp per layer (not ring passing), because:

- it runs only public PyTorch (``F.scaled_dot_product_attention`` with a lower-right
  ``CausalBias``), so the flash / memory-efficient kernels do the work on GPUs, autograd gives
  exact gradients (the all-gather's backward is a reduce-scatter), and the CPU tests exercise the
  very code the GPUs run. A ring needs each block's log-sum-exp and a hand-written backward
  around the kernels' private entry points, whose signatures change between torch releases;
- any mask is a mask over the gathered keys: padding, causal, documents of packed rows (their
  ``document_ids`` are all-gathered once per forward and travel with the keys), any of them together;
- the cost is what bounds it: attention compute grows as s², the gathered K/V as s and their
  traffic equals a ring's ((cp-1)/cp of the K/V per rank). The price is that the all-gather is
  not overlapped with compute and every rank keeps the full K/V of its heads for backward
  (2·s·b·h/tp elements per layer, about +25% activation memory at cp=2 over the 1/cp share
  of the rest). Llama 3 trains its long-context stage the same way.

Causal masking is by global position: the query chunk ``c`` sees keys ``[0, (c+1)·L)`` with the
lower-right causal mask, so each rank runs one short and one long attention and all ranks the
same work. A ``[b, s_local]`` padding mask (this rank's split, 1 = token) is all-gathered with
the keys.

Dropout: the attention probabilities of different cp ranks belong to different queries, so they
draw from a stream of their own per (tp, cp) rank, ``CONTEXT_PARALLEL_RNG`` in the rank's RNG
tracker, derived from its tp stream's seed (so reseeding and checkpoint replays reproduce it).
What holds with dropout > 0: a run is reproducible for a given seed and layout, activation
recomputation replays the same masks, gradients are exact for the drawn masks, and every
probability is dropped independently with probability p; the masks are NOT those of a cp=1 run,
so only dropout-free (or eval) outputs equal cp=1 outputs.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..context_parallel import all_gather_context_parallel, local_chunks
from ..context_parallel.split import check_local_sequence_length
from ..parallel import get_parallel_state
from ..tensor_parallel.mappings import eager_under_compile
from ..tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker
from .documents import DocumentMask, chunk_document_mask, gathered_ids

CONTEXT_PARALLEL_RNG = "context-parallel-rng"
_CP_SEED_OFFSET = 1_000_003   # far from the tp (2718 + tp) and ep (1024 + 100·ep + etp) offsets


def context_parallel_rng_fork(tracker: RNGStatesTracker, cp_rank: int) -> ContextManager[None]:
    """Fork this (tp, cp) rank's attention-dropout stream, creating it from the tp seed on first use."""
    if CONTEXT_PARALLEL_RNG not in tracker.states:
        tp_seeds = [seed for seed, name in tracker.seeds.items() if name == MODEL_PARALLEL_RNG]
        if not tp_seeds:
            raise KeyError(f"RNG state {MODEL_PARALLEL_RNG!r} was never added; call model_parallel_seed(seed) first.")
        seed = tp_seeds[0] + _CP_SEED_OFFSET * (cp_rank + 1)
        if tracker.seeds.get(seed, CONTEXT_PARALLEL_RNG) == CONTEXT_PARALLEL_RNG:
            tracker.seeds.pop(seed, None)   # a checkpoint replay restored states from before its creation
        tracker.add(CONTEXT_PARALLEL_RNG, seed)
    return tracker.fork(CONTEXT_PARALLEL_RNG)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               attention_mask: Optional[torch.Tensor] = None, causal: bool = True,
                               dropout_p: float = 0.0, group: Optional[dist.ProcessGroup] = None,
                               rng: Optional[ContextManager[None]] = None,
                               document_ids: Union[torch.Tensor, DocumentMask, None] = None,
                               window: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys: ``[b, heads, s_local, d]`` each.

    ``attention_mask``: ``[b, s_local]``, this rank's split (1 = token, 0 = padding), or None.
    ``group``: the cp group (default: the active state's). ``rng``: entered around the kernels, for
    dropout (``SelfAttention`` passes :func:`context_parallel_rng_fork`). ``document_ids``: ``[b, s_local]``,
    this rank's split of a packed batch's document ids (or their ``DocumentMask``): attention stays
    inside each document. ``window``: a causal sliding window (a query sees itself and the ``window - 1`` keys before
    it, by global position). ``scale``: the softmax scale (default ``head_dim ** -0.5``).
    """
    group = get_parallel_state().cp_group if group is None else group
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[-2]
    check_local_sequence_length(s_local, cp)
    if attention_mask is not None and attention_mask.shape[-1] != s_local:
        raise ValueError(
            f"attention_mask has {attention_mask.shape[-1]} positions but this context-parallel rank holds "
            f"{s_local} tokens; split the mask with split_for_context_parallel like the input ids.")
    # one all-gather for K and V, sequence-first so the collective needs no transposed copies
    kv = torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)              # [s/cp, 2, b, heads, d]
    k_all, v_all = all_gather_context_parallel(kv, seq_dim=0, group=group).permute(1, 2, 3, 0, 4).unbind(0)
    keep = None
    if attention_mask is not None:   # as uint8: gloo and nccl have no bool collectives
        keep = all_gather_context_parallel(attention_mask.to(torch.uint8), seq_dim=1, group=group).to(torch.bool)
    q_ids = k_ids = None
    if document_ids is not None:
        documents = DocumentMask.of(document_ids)
        documents.check(q.shape[0], s_local)
        q_ids, k_ids = gathered_ids(documents, lambda ids: all_gather_context_parallel(ids, seq_dim=1, group=group))
    with rng if rng is not None else contextlib.nullcontext():
        return local_query_attention(q, k_all, v_all, keep, causal, dropout_p, cp, rank, q_ids, k_ids, window, scale)


@eager_under_compile
def context_parallel_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    attention_mask: Optional[torch.Tensor], causal: bool, dropout_p: float,
                                    document_ids: Union[torch.Tensor, DocumentMask, None],
                                    window: Optional[int], scale: Optional[float]) -> torch.Tensor:
    """:func:`context_parallel_attention` over the active state's cp group, its dropout drawn from this rank's
    stream; all of it eager under ``torch.compile`` (one graph break: its all-gathers break the graph anyway).
    Traced (the attention's forward made the dropout stream's fork, creating the stream on first use, inside the
    compiled graph), a compiled cp2 run's gradients left eager's at the first step with dropout on GPUs."""
    state = get_parallel_state()
    rng = context_parallel_rng_fork(get_rng_tracker(state), state.cp_rank) if dropout_p > 0 else None
    return context_parallel_attention(q, k, v, attention_mask, causal, dropout_p, state.cp_group, rng, document_ids,
                                      window=window, scale=scale)


def local_query_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, keep: Optional[torch.Tensor],
                          causal: bool, dropout_p: float, cp_size: int, cp_rank: int,
                          q_documents: Optional[torch.Tensor] = None,
                          k_documents: Optional[torch.Tensor] = None, window: Optional[int] = None,
                          scale: Optional[float] = None) -> torch.Tensor:
    """The local part, a pure function: cp rank ``cp_rank``'s queries ``[b, heads, s/cp, d]`` against the
    whole sequence's keys/values ``[b, heads, s, d]`` in sequence order (fewer key/value heads than query
    heads: grouped-query attention); ``keep``: ``[b, s]`` bool or None. ``q_documents [b, s/cp]`` (this
    rank's split) and ``k_documents [b, s]`` (in sequence order): packed rows' document ids, or None. ``window``
    (causal only): keys more than ``window - 1`` positions before a query are hidden too."""
    chunk = q.shape[-2] // 2
    gqa = k_all.shape[-3] != q.shape[-3]
    if not causal:
        mask = None if keep is None else keep[:, None, None, :]
        if q_documents is not None:
            assert k_documents is not None   # given together
            same = chunk_document_mask(q_documents, k_documents)
            mask = same if mask is None else mask & same
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    outputs = []
    for slot, c in enumerate(local_chunks(cp_size, cp_rank)):
        end = (c + 1) * chunk                  # queries of chunk c see keys [0, end), lower-right causal
        if keep is None and q_documents is None and window is None:
            from torch.nn.attention.bias import causal_lower_right   # imports torch._dynamo: 1.6 s, on first use

            mask = causal_lower_right(chunk, end)
        else:
            mask = torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(end - chunk)
            if window is not None:   # query row i is global position end - chunk + i: keys after i - window
                mask = mask & ~torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(end - chunk - window)
            if keep is not None:
                mask = keep[:, None, None, :end] & mask
            if q_documents is not None:
                assert k_documents is not None   # given together
                mask = chunk_document_mask(q_documents[:, slot * chunk:(slot + 1) * chunk], k_documents[:, :end]) & mask
        outputs.append(F.scaled_dot_product_attention(
            q[..., slot * chunk:(slot + 1) * chunk, :], k_all[..., :end, :], v_all[..., :end, :],
            attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa))
    return torch.cat(outputs, dim=-2)
