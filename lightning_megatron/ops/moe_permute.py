"""Fused Triton kernels for ``permute``/``unpermute`` on CUDA: one pass over the hidden data each way.

The torch path (``permute.py``) builds the row order with a cumulative sum over the flat ``[E·T]`` map,
a scatter, a stable sort (dropless top-k) and copies the hidden rows with ``index_select``; its
un-permutation and backward use ``index_add`` (atomics, order-dependent) or gather + multiply + sum
passes through float32 copies of the rows. Here:

- ``route`` (two small kernels over the ``[T, E]`` map): per token block and expert a routed count,
  then each block's prefix over blocks and experts gives every routed ``(t, e)`` its row
  ``start[e] + (routed tokens of e before t)``, the same rows as ``routed_slots`` (expert-major, tokens in
  order, the first ``num_out`` kept). It writes ``slots`` and ``token_rows [T, W]``: each token's rows,
  experts ascending, ``-1`` after the last. Nothing comes back to the host.
- permute: each token's program reads its row once and writes it to its rows (no reads of other rows).
- unpermute: each token's program gathers its rows and adds them in float32, weighted by their
  probabilities, in a fixed order: deterministic, no atomics, no float32 copy of the rows.
- backward: permute's is that unpermute without probabilities; unpermute's writes each row's gradient
  ``grad_out[t]·p`` and its probability's gradient ``<grad_out[t], row>`` from the token's program.

Capacity: the router's padded map (``apply_capacity(..., pad_to_capacity=True)``) already holds exactly
``capacity`` tokens per expert (the kept ones, chosen by ``drop_policy``, plus filler tokens with probability
0), so its ``E·capacity`` rows come out padded and static-shaped (tokens in order within an expert) with no
per-expert logic here; which tokens drop is the router's choice, identical for both paths. Rows past the
routed count (``num_out`` larger than the routed tokens, which the dispatcher never asks for) are zero and
belong to no token; the torch path copies token 0 into them.

Triton is imported here only; ``permute.py`` imports this module for CUDA tensors only, so CPU
installs without Triton work. ``LM_MOE_PERMUTE_KERNELS=0`` or :func:`kernels_enabled` selects the torch
path (tests compare the two).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .switch import KernelSwitch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the torch path is used
    triton = None

ENV = "LM_MOE_PERMUTE_KERNELS"
SWITCH = KernelSwitch(ENV)
MAX_COLUMNS = 1024          # experts (map columns) one index-kernel tile holds


def enabled() -> bool:
    """Whether CUDA tensors take the kernels: Triton is importable and the switch is on."""
    return triton is not None and SWITCH.on()


kernels_enabled = SWITCH.forced_to   # ``with kernels_enabled(False):`` the torch path


if triton is not None:

    @triton.jit
    def _count_kernel(map_ptr, counts_ptr, T, E, stride_t, stride_e, BT: tl.constexpr, BE: tl.constexpr):
        """counts[b, e] = routed tokens of expert e in token block b."""
        pid = tl.program_id(0)
        offs_t = pid * BT + tl.arange(0, BT)
        offs_e = tl.arange(0, BE)
        mask = (offs_t < T)[:, None] & (offs_e < E)[None, :]
        m = tl.load(map_ptr + offs_t[:, None] * stride_t + offs_e[None, :] * stride_e, mask=mask, other=0)
        tl.store(counts_ptr + pid * E + offs_e, tl.sum((m != 0).to(tl.int32), axis=0), mask=offs_e < E)

    @triton.jit
    def _index_kernel(map_ptr, counts_ptr, slots_ptr, token_rows_ptr, T, E, num_out, NB, W, stride_t, stride_e,
                      BT: tl.constexpr, BE: tl.constexpr, BW: tl.constexpr, CB: tl.constexpr, BF: tl.constexpr):
        """Rows of this token block's routed slots; writes slots (fillers 0) and the token lists."""
        pid = tl.program_id(0)
        offs_e = tl.arange(0, BE)
        e_ok = offs_e < E
        totals = tl.zeros([BE], dtype=tl.int32)
        before = tl.zeros([BE], dtype=tl.int32)
        for b0 in range(0, NB, CB):
            offs_b = b0 + tl.arange(0, CB)
            c = tl.load(counts_ptr + offs_b[:, None] * E + offs_e[None, :],
                        mask=(offs_b < NB)[:, None] & e_ok[None, :], other=0)
            totals += tl.sum(c, axis=0)
            before += tl.sum(tl.where((offs_b < pid)[:, None], c, 0), axis=0)
        start = tl.cumsum(totals, axis=0) - totals + before            # this block's first row per expert
        offs_t = pid * BT + tl.arange(0, BT)
        t_ok = offs_t < T
        m = tl.load(map_ptr + offs_t[:, None] * stride_t + offs_e[None, :] * stride_e,
                    mask=t_ok[:, None] & e_ok[None, :], other=0).to(tl.int32)
        m = tl.where(m != 0, 1, 0)
        row = start[None, :] + tl.cumsum(m, axis=0) - m
        kept = (m != 0) & (row < num_out)
        slot = offs_e[None, :].to(tl.int64) * T + offs_t[:, None]
        tl.store(slots_ptr + row, slot, mask=kept)
        k = kept.to(tl.int32)
        j = tl.cumsum(k, axis=1) - k                                    # position in the token's list
        base = offs_t.to(tl.int64)[:, None] * W
        tl.store(token_rows_ptr + base + j, row.to(tl.int64), mask=kept & (j < W))
        n = tl.sum(k, axis=1)
        offs_w = tl.arange(0, BW)
        tl.store(token_rows_ptr + base + offs_w[None, :], tl.full([BT, BW], -1, tl.int64),
                 mask=t_ok[:, None] & (offs_w[None, :] >= n[:, None]) & (offs_w < W)[None, :])
        total = tl.sum(totals, axis=0)
        for f0 in range(total + pid * BF, num_out, NB * BF):             # rows past the routed ones
            offs_f = f0 + tl.arange(0, BF)
            tl.store(slots_ptr + offs_f, tl.zeros([BF], dtype=tl.int64), mask=offs_f < num_out)

    @triton.jit
    def _list_length(token_rows_ptr, t, W, BW: tl.constexpr):
        """Rows in token t's list (entries before the first -1)."""
        offs_w = tl.arange(0, BW)
        ids = tl.load(token_rows_ptr + t * W + offs_w, mask=offs_w < W, other=-1)
        return tl.sum((ids >= 0).to(tl.int32), axis=0)

    @triton.jit
    def _scatter_kernel(src_ptr, token_rows_ptr, probs_ptr, rows_ptr, out_ptr, grad_probs_ptr, H, W, h_span,
                        HAS_PROBS: tl.constexpr, DOT: tl.constexpr, COUNT: tl.constexpr, KB: tl.constexpr,
                        BW: tl.constexpr, BH: tl.constexpr):
        """out[r] = src[t] (· p[r]) for each row r of token t; ``DOT``: also grad_probs[r] = <src[t], rows[r]>.

        permute's forward (src = tokens) and unpermute's backward (src = grad_out).
        """
        t = tl.program_id(0).to(tl.int64)
        h_lo = tl.program_id(1) * h_span
        h_hi = tl.minimum(h_lo + h_span, H)
        if COUNT:
            n = _list_length(token_rows_ptr, t, W, BW)
        else:
            n = W
        for j0 in range(0, n, KB):
            offs_j = j0 + tl.arange(0, KB)
            ids = tl.load(token_rows_ptr + t * W + offs_j, mask=offs_j < n, other=-1)
            ok = ids >= 0
            if HAS_PROBS:
                p = tl.load(probs_ptr + ids, mask=ok, other=0.0).to(tl.float32)
            else:
                p = tl.full([KB], 1.0, tl.float32)
            dots = tl.zeros([KB], dtype=tl.float32)
            for h0 in range(h_lo, h_hi, BH):
                offs_h = h0 + tl.arange(0, BH)
                h_ok = offs_h < h_hi
                x = tl.load(src_ptr + t * H + offs_h, mask=h_ok, other=0.0)
                mask = ok[:, None] & h_ok[None, :]
                dst = ids[:, None] * H + offs_h[None, :]
                if HAS_PROBS:
                    y = x.to(tl.float32)[None, :] * p[:, None]
                else:
                    y = tl.broadcast_to(x[None, :], (KB, BH))
                if DOT:
                    r = tl.load(rows_ptr + dst, mask=mask, other=0.0).to(tl.float32)
                    dots += tl.sum(r * x.to(tl.float32)[None, :], axis=1)
                tl.store(out_ptr + dst, y.to(out_ptr.dtype.element_ty), mask=mask)
            if DOT:
                tl.store(grad_probs_ptr + ids, dots.to(grad_probs_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_kernel(rows_ptr, token_rows_ptr, probs_ptr, out_ptr, H, W, HAS_PROBS: tl.constexpr,
                        COUNT: tl.constexpr, KB: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr):
        """out[t] = sum over token t's rows r of rows[r] (· p[r]), in float32, list order.

        unpermute's forward and permute's backward (rows = grad_rows, no probs).
        """
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        h_ok = offs_h < H
        if COUNT:
            n = _list_length(token_rows_ptr, t, W, BW)
        else:
            n = W
        acc = tl.zeros([BH], dtype=tl.float32)
        for j0 in range(0, n, KB):
            offs_j = j0 + tl.arange(0, KB)
            ids = tl.load(token_rows_ptr + t * W + offs_j, mask=offs_j < n, other=-1)
            ok = ids >= 0
            x = tl.load(rows_ptr + ids[:, None] * H + offs_h[None, :], mask=ok[:, None] & h_ok[None, :],
                        other=0.0).to(tl.float32)
            if HAS_PROBS:
                x = x * tl.load(probs_ptr + ids, mask=ok, other=0.0).to(tl.float32)[:, None]
            acc += tl.sum(x, axis=0)
        tl.store(out_ptr + t * H + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)

    @triton.jit
    def _zero_fillers_kernel(slots_ptr, token_rows_ptr, out_ptr, grad_probs_ptr, num_out, H,
                             HAS_PROBS: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
        """Zero the rows past the routed ones: slot 0 anywhere but a real row 0 (token 0's first row)."""
        offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
        r_ok = offs_r < num_out
        s = tl.load(slots_ptr + offs_r, mask=r_ok, other=1)
        first = tl.load(token_rows_ptr)
        filler = r_ok & (s == 0) & ((offs_r > 0) | (first != 0))
        if tl.max(filler.to(tl.int32), axis=0) > 0:
            for h0 in range(0, H, BH):
                offs_h = h0 + tl.arange(0, BH)
                tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * H + offs_h[None, :],
                         tl.zeros([BR, BH], dtype=out_ptr.dtype.element_ty),
                         mask=filler[:, None] & (offs_h < H)[None, :])
            if HAS_PROBS:
                tl.store(grad_probs_ptr + offs_r, tl.zeros([BR], dtype=grad_probs_ptr.dtype.element_ty),
                         mask=filler)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def route(routing_map: Tensor, num_out: int, width: int) -> Tuple[Tensor, Tensor]:
    """``(slots [num_out] int64, token_rows [T, width] int64)`` of ``routing_map [T, E]``.

    ``slots`` equals ``routed_slots(routing_map, num_out)``; ``token_rows[t]`` lists token ``t``'s rows,
    experts ascending, then ``-1``. ``width`` bounds the rows of one token (``k`` when each has exactly
    ``k``, else ``E``); a longer list is cut, so only pass ``k`` for a top-``k`` map.
    """
    num_tokens, num_experts = routing_map.shape
    device = routing_map.device
    mp = routing_map.view(torch.uint8) if routing_map.dtype == torch.bool else routing_map
    be = _pow2(num_experts)
    bt = max(16, min(256, 8192 // be))
    nb = triton.cdiv(num_tokens, bt)
    counts = torch.empty((nb, num_experts), dtype=torch.int32, device=device)
    slots = torch.empty(num_out, dtype=torch.long, device=device)
    token_rows = torch.empty((num_tokens, width), dtype=torch.long, device=device)
    _count_kernel[(nb,)](mp, counts, num_tokens, num_experts, mp.stride(0), mp.stride(1), BT=bt, BE=be,
                         num_warps=4)
    _index_kernel[(nb,)](mp, counts, slots, token_rows, num_tokens, num_experts, num_out, nb, width,
                         mp.stride(0), mp.stride(1), BT=bt, BE=be, BW=_pow2(width), CB=max(1, 4096 // be),
                         BF=1024, num_warps=4)
    return slots, token_rows


def _tiles(width: int, count: bool, hidden: int, num_rows: int, num_tokens: int) -> Tuple[int, int, int]:
    """(rows gathered at once, hidden columns at once, warps): about 4096 elements per tile. Short lists
    (``count``) are read in chunks of about the mean rows per token, so few lanes of a tile idle."""
    kb = min(_pow2(width), 8, _pow2(triton.cdiv(num_rows, num_tokens))) if count else _pow2(width)
    bh = max(64, min(_pow2(hidden), 4096 // kb))
    return kb, bh, 4 if kb * bh <= 4096 else 8


def _scatter(src: Tensor, token_rows: Tensor, num_out: int, slots: Optional[Tensor], out_dtype: torch.dtype,
             probs: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Copy each token's row (times its rows' probabilities) to its rows: ``[num_out, H]``. With ``rows``
    also the probabilities' gradient ``<src[t], rows[r]>``. ``slots`` given: lists may be short and rows
    past the routed ones may exist (zeroed here). Returns (out, grad_probs or None)."""
    num_tokens, width = token_rows.shape
    hidden = src.shape[1]
    src = src.contiguous()
    dot = rows is not None
    out = torch.empty((num_out, hidden), dtype=out_dtype, device=src.device)
    grad_probs: Optional[Tensor] = None
    if rows is not None:
        assert probs is not None   # the gradient of the probabilities that scaled the rows
        grad_probs = torch.empty(num_out, dtype=probs.dtype, device=src.device)
    count = slots is not None
    kb, bh, warps = _tiles(width, count, hidden, num_out, num_tokens)
    grid, span = ((num_tokens, 1), hidden) if dot else ((num_tokens, triton.cdiv(hidden, bh)), bh)
    _scatter_kernel[grid](src, token_rows, probs if probs is not None else out,
                          rows.contiguous() if rows is not None else out, out, grad_probs if dot else out,
                          hidden, width, span,
                          HAS_PROBS=probs is not None, DOT=dot, COUNT=count, KB=kb, BW=_pow2(width), BH=bh,
                          num_warps=warps)
    if count:
        br = 16
        _zero_fillers_kernel[(triton.cdiv(num_out, br),)](slots, token_rows, out, grad_probs if dot else out,
                                                           num_out, hidden, HAS_PROBS=dot, BR=br,
                                                           BH=min(_pow2(hidden), 256), num_warps=4)
    return out, grad_probs


def _combine(rows: Tensor, token_rows: Tensor, count: bool, out_dtype: torch.dtype,
             probs: Optional[Tensor] = None) -> Tensor:
    """Each token's rows summed in float32 (times their probabilities): ``[T, H]`` in ``out_dtype``."""
    num_tokens, width = token_rows.shape
    hidden = rows.shape[1]
    rows = rows.contiguous()
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=rows.device)
    kb, bh, warps = _tiles(width, count, hidden, rows.shape[0], num_tokens)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, bh))](
        rows, token_rows, probs if probs is not None else rows, out, hidden, width,
        HAS_PROBS=probs is not None, COUNT=count, KB=kb, BW=_pow2(width), BH=bh, num_warps=warps)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, slots: Optional[Tensor], token_rows: Tensor, num_out: int):
        ctx.save_for_backward(token_rows)
        ctx.count, ctx.shape = slots is not None, tokens.shape
        rows, _ = _scatter(tokens.reshape(tokens.shape[0], -1), token_rows, num_out, slots, tokens.dtype)
        return rows.view((num_out,) + tuple(tokens.shape[1:]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (token_rows,) = ctx.saved_tensors
        g = _combine(grad.reshape(grad.shape[0], -1), token_rows, ctx.count, grad.dtype)
        return g.view(ctx.shape), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, probs: Optional[Tensor], slots: Optional[Tensor], token_rows: Tensor,
                out_dtype: torch.dtype):
        flat = rows.reshape(rows.shape[0], -1)
        keep_rows = probs is not None and ctx.needs_input_grad[1]    # only the probabilities' gradient reads them
        ctx.save_for_backward(flat if keep_rows else None, probs, slots, token_rows)
        ctx.shape, ctx.rows_dtype = rows.shape, rows.dtype
        out = _combine(flat, token_rows, slots is not None, out_dtype, probs)
        return out.view((token_rows.shape[0],) + tuple(rows.shape[1:]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, probs, slots, token_rows = ctx.saved_tensors
        grad_rows, grad_probs = _scatter(grad.reshape(grad.shape[0], -1), token_rows, ctx.shape[0], slots,
                                         ctx.rows_dtype, probs, rows)
        return grad_rows.view(ctx.shape), grad_probs, None, None, None


def permute(tokens: Tensor, routing_map: Tensor, num_out: int, topk: Optional[int] = None
            ) -> Tuple[Tensor, Tensor, Tensor]:
    """Kernel ``permute``: ``(rows, slots, token_rows)``. ``topk``: every token has exactly ``topk`` routed
    slots and ``num_out = T·topk`` (then ``token_rows.view(-1)`` is the torch path's ``token_order``)."""
    width = topk if topk is not None else routing_map.shape[1]
    slots, token_rows = route(routing_map, num_out, width)
    rows = _Permute.apply(tokens, slots if topk is None else None, token_rows, num_out)
    return rows, slots, token_rows


def unpermute(rows: Tensor, token_rows: Tensor, slots: Optional[Tensor], probs: Optional[Tensor] = None,
              out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Kernel ``unpermute`` with the token lists from :func:`permute` (``slots=None``: exactly ``k`` per token).

    The result's dtype follows the torch path: ``out_dtype``, else rows promoted with the probabilities.
    """
    dtype = out_dtype or (rows.dtype if probs is None else torch.promote_types(rows.dtype, probs.dtype))
    return _Unpermute.apply(rows, None if probs is None else probs.contiguous(), slots, token_rows, dtype)
