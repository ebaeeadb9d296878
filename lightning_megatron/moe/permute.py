"""Reorder tokens into expert-major rows and back, with static shapes and exact gradients.

A routed token is one True of ``routing_map [T, E]``; its *slot* is ``e·T + t`` (the flat
index of ``routing_map.T``). ``permute`` lists the slots expert by expert (tokens in order within
an expert) and copies the token rows; ``unpermute`` adds each row back to its token. The copies
are ``index_select``/``index_add`` pairs, conjugate to each other, so values and gradients are
restored exactly (a token routed to k experts gets the sum of its k rows).

No host sync: the number of rows is passed in (``T·k`` when dropless, ``E·capacity`` when padded).

On CUDA with Triton, ``permute``/``permute_indexed``/``permute_per_token`` and the un-permutations given the
token lists they return run fused kernels (``permute_kernels``): the same rows and slots, float32 sums
without atomics. Everything else, and ``LM_MOE_PERMUTE_KERNELS=0``, takes the torch code below.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def routed_slots(routing_map: Tensor, num_out: int) -> Tensor:
    """Slots (``e·T + t``) of the first ``num_out`` routed tokens in expert-major order, ``[num_out]``.

    A cumulative count gives each routed slot its row; unrouted slots (and any beyond
    ``num_out``) are written to one extra row that is dropped, so the shape never depends on data.
    """
    flat = routing_map.t().reshape(-1)
    row = flat.cumsum(0) - 1
    target = torch.where(flat & (row < num_out), row, torch.full_like(row, num_out))
    slots = torch.zeros(num_out + 1, dtype=torch.long, device=flat.device)
    slots.scatter_(0, target, torch.arange(flat.numel(), device=flat.device))
    return slots[:num_out]


def _kernels(x: Tensor, routing_map: Optional[Tensor] = None, num_out: int = 1):
    """The Triton kernels' module when it takes these tensors (CUDA, Triton, switched on), else None."""
    if not x.is_cuda or x.shape[0] == 0 or num_out == 0:
        return None
    from ..ops import moe_permute as permute_kernels
    if not permute_kernels.enabled():
        return None
    if routing_map is not None and not 0 < routing_map.shape[1] <= permute_kernels.MAX_COLUMNS:
        return None
    return permute_kernels


def permute(tokens: Tensor, routing_map: Tensor, num_out: int) -> tuple[Tensor, Tensor]:
    """Rows of ``tokens [T, H]`` for every routed slot, grouped by expert. Returns (rows, slots)."""
    return permute_indexed(tokens, routing_map, num_out)[:2]


def permute_indexed(tokens: Tensor, routing_map: Tensor, num_out: int) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``permute`` plus each token's rows (``token_rows [T, E]``, ``-1`` after the last) when the kernels ran,
    else None: passed to ``unpermute`` it lets the kernel add each token's rows without atomics."""
    kernels = _kernels(tokens, routing_map, num_out)
    if kernels is not None:
        return kernels.permute(tokens, routing_map, num_out)
    slots = routed_slots(routing_map, num_out)
    return tokens.index_select(0, slots % routing_map.shape[0]), slots, None


def permute_probs(probs: Tensor, slots: Tensor) -> Tensor:
    """The routing probability of each permuted row (``probs [T, E]`` read at ``slots``)."""
    return probs.t().reshape(-1).index_select(0, slots)


def unpermute(rows: Tensor, slots: Tensor, num_tokens: int, probs: Optional[Tensor] = None,
              out_dtype: Optional[torch.dtype] = None, token_rows: Optional[Tensor] = None) -> Tensor:
    """Sum the rows back into their tokens, each weighted by its probability when given: ``[T, H]``.

    Accumulates in float32 when ``probs`` are float32 (router precision), then casts to ``out_dtype``.
    ``token_rows`` (from ``permute_indexed``) selects the kernel on CUDA; without it, ``index_add``.
    """
    if token_rows is not None and _kernels(rows) is not None:
        if token_rows.shape[0] != num_tokens:
            raise ValueError(f"token_rows lists {token_rows.shape[0]} tokens, num_tokens={num_tokens}.")
        from ..ops.moe_permute import unpermute as unpermute_kernel
        return unpermute_kernel(rows, token_rows, slots, probs, out_dtype)
    if probs is not None:
        rows = rows.to(torch.promote_types(rows.dtype, probs.dtype)) * probs.unsqueeze(-1)
    out = rows.new_zeros((num_tokens,) + tuple(rows.shape[1:]))
    out = out.index_add(0, slots % num_tokens, rows)
    return out if out_dtype is None else out.to(out_dtype)


def chunk_sort_index(counts: Tensor, total: int) -> Tensor:
    """Row order that regroups source-major chunks into expert-major chunks.

    Rows arrive as chunks ``(source s, expert i)`` of ``counts[s, i]`` rows, ``s`` outer; the
    result ``idx`` makes ``rows[idx]`` ordered ``(i, s)``. ``total`` = ``counts.sum()``, known on
    the host, so ``repeat_interleave`` needs no sync.
    """
    sources, experts = counts.shape
    device = counts.device
    src_start = counts.reshape(-1).cumsum(0) - counts.reshape(-1)             # chunk (s, i) starts
    dst_counts = counts.t().reshape(-1)                                         # chunks in (i, s) order
    dst_start = dst_counts.cumsum(0) - dst_counts
    chunk = torch.repeat_interleave(torch.arange(experts * sources, device=device), dst_counts,
                                    output_size=total)
    within = torch.arange(total, device=device) - dst_start[chunk]
    expert, source = chunk // sources, chunk % sources
    return src_start[source * experts + expert] + within


def inverse_permutation(index: Tensor) -> Tensor:
    """``inv`` with ``inv[index[j]] = j``."""
    return torch.empty_like(index).scatter_(0, index, torch.arange(index.numel(), device=index.device))


# --- the dropless fast path: every token has exactly k rows -------------------------------------------
#
# ``index_select``'s backward (and ``unpermute``'s forward) add rows into tokens with ``index_add``:
# atomics, slow in bfloat16 on GPUs (1.8 ms of a 9 ms MoE layer on an H200) and order-dependent.
# When every token has exactly ``k`` rows, the rows sorted by token (``token_order``) make both a
# gather followed by a sum over ``k``: no atomics, the same sum order every time.


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, source: Tensor, token_order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(token_order)
        ctx.k, ctx.num_tokens = k, tokens.shape[0]
        return tokens.index_select(0, source)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (token_order,) = ctx.saved_tensors
        rows = grad.index_select(0, token_order)
        return rows.view((ctx.num_tokens, ctx.k) + tuple(grad.shape[1:])).sum(dim=1), None, None, None


class _GatherPermutation(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``: the backward is the gather by its inverse."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def gather_permutation(x: Tensor, index: Tensor, inverse: Optional[Tensor] = None) -> Tensor:
    """``x.index_select(0, index)`` where ``index`` permutes the rows, with a gather as backward."""
    return _GatherPermutation.apply(x, index, inverse_permutation(index) if inverse is None else inverse)


def permute_per_token(tokens: Tensor, routing_map: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``permute`` when every token is routed to exactly ``k`` experts (dropless top-k).

    Returns ``(rows, slots, token_order)``; ``token_order`` lists the ``T·k`` rows token by token
    (experts ascending within a token), which ``unpermute_per_token`` and the backward use.
    """
    num_tokens = routing_map.shape[0]
    kernels = _kernels(tokens, routing_map, num_tokens * k)
    if kernels is not None:
        rows, slots, token_rows = kernels.permute(tokens, routing_map, num_tokens * k, topk=k)
        return rows, slots, token_rows.view(-1)
    slots = routed_slots(routing_map, num_tokens * k)
    source = slots % num_tokens
    token_order = torch.argsort(source, stable=True)
    return _PermuteTokens.apply(tokens, source, token_order, k), slots, token_order


def unpermute_per_token(rows: Tensor, token_order: Tensor, num_tokens: int, probs: Optional[Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``unpermute`` for rows from ``permute_per_token``: each token sums its ``k`` rows in order.

    The rows are regrouped in their own dtype and weighted after (one mixed-dtype multiply computes in
    the probabilities' float32), so no float32 copy of the rows is made or kept for the backward.
    """
    k = rows.shape[0] // num_tokens
    if _kernels(rows) is not None:
        from ..ops.moe_permute import unpermute as unpermute_kernel
        return unpermute_kernel(rows, token_order.view(num_tokens, k), None, probs, out_dtype)
    inverse = inverse_permutation(token_order)
    grouped = gather_permutation(rows, token_order, inverse).view((num_tokens, k) + tuple(rows.shape[1:]))
    if probs is not None:
        weights = gather_permutation(probs, token_order, inverse).view((num_tokens, k) + (1,) * (rows.dim() - 1))
        grouped = grouped * weights
    out = grouped.sum(dim=1)
    return out if out_dtype is None else out.to(out_dtype)
