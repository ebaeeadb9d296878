"""Vocab-parallel cross-entropy fused with the output projection, chunked over tokens.

``vocab_parallel_cross_entropy`` needs the ``[tokens, V/tp]`` logits whole, and in float32: at
16k tokens and a 50k vocabulary that is 3.3 GB per copy, several of which are alive at the end of
the forward and the start of the backward (the step's memory peak). Here the logits exist one
chunk of ``chunk_size`` tokens at a time, in the forward and again in the backward:

- forward, per chunk: logits in the input dtype (fp32 accumulation, as ``F.linear``), then this
  shard's max, sum of ``exp(logit - max)``, target logit and (for label smoothing) logit sum per
  token. After the last chunk two collectives over the tp group for the whole batch, not per
  chunk: a MAX of the shard maxima, then one SUM of the rescaled sums of exponentials, target
  logits and logit sums (``logsumexp`` combines exactly across shards). Only the per-token
  ``logsumexp`` is kept for the backward, beside the inputs the projection saves anyway.
- backward, per chunk: the logits again (one more GEMM), ``softmax - (1-α)·onehot - α/V`` times
  the per-token output gradient, rounded to the input dtype as the unfused path rounds it, then
  that chunk's rows of ``grad_hidden`` and its share of ``grad_weight``, which the GEMM adds into
  the weight gradient itself (beta = 1: no temporary; in bf16 one rounding per chunk, where the
  unfused path rounds once).

Extra memory is O(chunk × V/tp) instead of O(tokens × V/tp). Computing the gradients in the
forward instead would save the GEMM, but ``grad_weight = Σ_t g_t · dlogits_tᵀ h_t`` needs the
per-token output gradients ``g_t``, which only the backward knows (the loss is returned per token).

``logit_softcapping`` c (Gemma 2): each chunk's logits become ``c · tanh(logits / c)`` (in their dtype, as the
unfused path caps them) before the statistics, and their gradient is the capped logits' times ``1 - (capped / c)²``.

The result equals ``vocab_parallel_cross_entropy(F.linear(hidden, weight, bias), ...)``: padding
columns beyond ``vocab_size`` take no mass (their rows are not even multiplied), label smoothing
is over the global vocabulary, ``ignore_index`` tokens give loss 0 and no gradient.

On CUDA, where Triton is installed, each chunk's statistics and its logits' gradient are one Triton
pass each (read the logits once; write the gradient over them) instead of half a dozen torch passes
through float32 copies. On an H100 (GPT-1.3B shape, micro-batch 8, benchmarks/bench_cross_entropy.py)
the torch passes make the step 3% (V=50304) to 7% (V=128256) slower than the unfused path; with the
kernels it is 0.4% to 3% faster: they pay for the recomputed GEMM.
``LM_FUSED_CE_KERNELS=0`` or :func:`kernels_enabled` selects the torch passes (tests compare the two).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops.switch import KernelSwitch

from .mappings import (
    all_reduce, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, resolve_group,
)
from .token_ids import check_ids_in_vocab

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the torch passes
    triton = None

ENV = "LM_FUSED_CE_KERNELS"
SWITCH = KernelSwitch(ENV)
BLOCK = 2048                     # vocabulary columns a kernel program holds at once


class WholeLogitsGemms(Protocol):
    """The whole-logits path's three GEMMs: ``forward`` gives the logits and the weight as ``grad_hidden`` reads
    it, ``quantize_grad`` keeps the logits' gradient ``D`` as the backward's GEMMs read it (until the backward).
    :data:`INPUT_DTYPE_GEMMS` multiplies in the input dtype; ``quantization.float8_output.Float8OutputLayer`` in
    float8."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]: ...

    def quantize_grad(self, grad_logits: torch.Tensor) -> Tuple[torch.Tensor, ...]: ...

    def grad_hidden(self, grad_q: Tuple[torch.Tensor, ...], weight_q: Tuple[torch.Tensor, ...],
                    dtype: torch.dtype) -> torch.Tensor: ...

    def grad_weight(self, grad_q: Tuple[torch.Tensor, ...], hidden: torch.Tensor,
                    row_scale: torch.Tensor) -> torch.Tensor: ...

    def grad_bias(self, grad_q: Tuple[torch.Tensor, ...], row_scale: torch.Tensor) -> torch.Tensor: ...


class LowPrecisionGemms(WholeLogitsGemms, Protocol):
    """:class:`WholeLogitsGemms` in low precision, which also checks the shapes it can multiply and, called, is the
    unfused projection (``parallel_logits``'s ``matmul``)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        ...

    def check_shapes(self, tokens: int, rows: int, hidden: int) -> None: ...


class _InputDtypeGemms:
    """The whole-logits GEMMs in the input dtype (float32 accumulation, as ``F.linear``)."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        return F.linear(hidden, weight, bias), (weight,)

    def quantize_grad(self, grad_logits: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return (grad_logits,)

    def grad_hidden(self, grad_q: Tuple[torch.Tensor, ...], weight_q: Tuple[torch.Tensor, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        return torch.mm(grad_q[0], weight_q[0])

    def grad_weight(self, grad_q: Tuple[torch.Tensor, ...], hidden: torch.Tensor,
                    row_scale: torch.Tensor) -> torch.Tensor:
        return torch.mm(grad_q[0].t(), (hidden.to(torch.float32) * row_scale).to(hidden.dtype))

    def grad_bias(self, grad_q: Tuple[torch.Tensor, ...], row_scale: torch.Tensor) -> torch.Tensor:
        return grad_q[0].t().to(torch.float32) @ row_scale[:, 0]


INPUT_DTYPE_GEMMS: WholeLogitsGemms = _InputDtypeGemms()


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether ``x``'s chunks take the Triton passes: a CUDA tensor, Triton importable, the switch on."""
    return triton is not None and x.is_cuda and SWITCH.on()


fused_kernels_run = _use_kernels            # public: whether the fused loss runs its Triton passes on ``x``
kernels_enabled = SWITCH.forced_to   # ``with kernels_enabled(False):`` the torch passes


if triton is not None:

    @triton.jit
    def _stats_kernel(logits_ptr, target_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, logit_sum_ptr, V,
                      SMOOTHING: tl.constexpr, BLOCK: tl.constexpr):
        """One row of ``[c, V]`` logits: its max, Σ exp(x - max) (online over blocks: one exp per
        logit), the logit at ``target`` (-1: none here) and, for label smoothing, Σ x; in float32."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * V
        row_max = -3.0e38          # finite: exp(row_max - new_max) never sees inf - inf
        sum_exp = 0.0
        total = 0.0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            row_max = new_max
            if SMOOTHING:
                total += tl.sum(tl.where(inside, x, 0.0), axis=0)
        tl.store(max_ptr + row, row_max)
        tl.store(sum_exp_ptr + row, sum_exp)
        target = tl.load(target_ptr + row)
        picked = tl.load(base + tl.maximum(target, 0)).to(tl.float32)
        tl.store(target_logit_ptr + row, tl.where(target >= 0, picked, 0.0))
        if SMOOTHING:
            tl.store(logit_sum_ptr + row, total)

    @triton.jit
    def _grad_kernel(logits_ptr, target_ptr, lse_ptr, scale_ptr, V, hit, uniform, BLOCK: tl.constexpr):
        """Over one row of logits, in place: ``(exp(x - lse) - uniform + hit·[col == target]) · scale``,
        rounded to the logits' dtype (``uniform`` = α/V, ``hit`` = -(1-α), target -1: none here)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * V
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr + row)
        target = tl.load(target_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.load(base + cols, mask=inside, other=0.0)
            grad = tl.exp(x.to(tl.float32) - lse) - uniform
            grad = tl.where(cols == target, grad + hit, grad) * scale
            tl.store(base + cols, grad.to(x.dtype), mask=inside)


def _chunks(n: int, size: int):
    return ((start, min(start + size, n)) for start in range(0, n, size))


def _chunk_stats(logits: torch.Tensor, target: torch.Tensor, smoothing: bool, out: torch.Tensor) -> None:
    """``out[:, rows] = (max, Σ exp(x - max), x[target], Σ x)`` of each row of one chunk's logits
    (``target`` -1 where the target is not in this shard; ``Σ x`` only with ``smoothing``)."""
    if _use_kernels(logits):
        _stats_kernel[(logits.shape[0],)](logits, target, out[0], out[1], out[2], out[3] if smoothing else out[2],
                                          logits.shape[1], SMOOTHING=smoothing, BLOCK=BLOCK, num_warps=8)
        return
    row_max = logits.max(dim=-1).values.float()
    out[0] = row_max
    picked = logits.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1).float()
    out[2] = torch.where(target >= 0, picked, torch.zeros_like(picked))
    if smoothing:
        out[3] = logits.sum(dim=-1, dtype=torch.float32)
    shifted = torch.sub(logits, row_max[:, None])     # promotes to float32, as .float() would
    out[1] = shifted.exp_().sum(dim=-1)


def _chunk_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                smoothing: float, vocab_size: int) -> torch.Tensor:
    """d loss / d logits of one chunk, times each token's ``scale``, in the logits' dtype (the Triton
    pass writes it over ``logits``)."""
    hit, uniform = smoothing - 1.0, smoothing / vocab_size
    if _use_kernels(logits):
        _grad_kernel[(logits.shape[0],)](logits, target, lse, scale, logits.shape[1], hit, uniform, BLOCK=BLOCK,
                                         num_warps=8)
        return logits
    grad = torch.sub(logits, lse[:, None]).exp_()                      # softmax, float32
    if smoothing > 0:
        grad.sub_(uniform)
    in_shard = target >= 0
    grad.scatter_add_(-1, target.clamp(min=0)[:, None], (hit * in_shard.float())[:, None])
    out = torch.empty(grad.shape, dtype=logits.dtype, device=grad.device)
    return torch.mul(grad, scale[:, None], out=out)   # rounded to the logits' dtype, as unfused


def _capped(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` in the logits' dtype (as ``GPTModel`` caps the unfused logits), or the logits."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _uncap_grad(grad: torch.Tensor, capped: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """d loss / d logits from d loss / d capped logits: times ``1 - tanh²`` (``capped / cap`` is the tanh), in the
    logits' dtype as autograd's tanh backward on the unfused path (no float32 copy of the logits)."""
    if cap is None:
        return grad
    return grad * _slope(capped, cap)


def _slope(capped: torch.Tensor, cap: float) -> torch.Tensor:
    return (capped / cap).square_().neg_().add_(1.0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, label_smoothing, ignore_index, vocab_size, chunk_size, group,
                cap, gemms):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        partition = weight.shape[0]
        start = rank * partition
        real = max(0, min(partition, vocab_size - start))   # rows of this shard inside the vocabulary
        n = hidden.shape[0]
        hidden = hidden.contiguous()
        w = weight[:real]
        b = bias[:real] if bias is not None else None

        ignored = target == ignore_index
        in_shard = (target >= start) & (target < start + real) & ~ignored
        local_target = torch.where(in_shard, target - start, torch.full_like(target, -1))   # -1: not here
        smoothing = label_smoothing > 0
        # rows: this shard's max, Σ exp(logit - max), target logit, Σ logits (label smoothing)
        stats = torch.zeros(4 if smoothing else 3, n, dtype=torch.float32, device=hidden.device)
        stats[0] = float("-inf")   # a shard holding only padding rows: no mass
        whole = chunk_size is None   # the logits whole, their gradient made here (see linear_cross_entropy)
        logits = None
        weight_q: Tuple[torch.Tensor, ...] = ()
        if gemms is not None:
            gemms.check_shapes(n, real, hidden.shape[1])
        whole_gemms: WholeLogitsGemms = gemms if gemms is not None else INPUT_DTYPE_GEMMS
        with torch.autocast(hidden.device.type, enabled=False):
            for lo, hi in _chunks(n, n if whole else chunk_size) if real > 0 and n > 0 else ():
                if whole:   # one chunk
                    logits, weight_q = whole_gemms.forward(hidden, w, b)
                    logits = _capped(logits, cap)                                       # [n, real], input dtype
                else:
                    logits = _capped(F.linear(hidden[lo:hi], w, b), cap)                 # [c, real], input dtype
                _chunk_stats(logits, local_target[lo:hi], smoothing, stats[:, lo:hi])
                if not whole:
                    del logits

        if world > 1:
            global_max = stats[0].clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            stats[1] *= torch.exp(stats[0] - global_max)   # to the global max; a padding shard: 0 · exp(-inf) = 0
            stats = all_reduce(stats[1:].contiguous(), group)
        else:
            global_max, stats = stats[0], stats[1:]
        lse = global_max + stats[0].log()
        loss = lse - stats[1]
        if smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stats[2] / vocab_size)
        loss = torch.where(ignored, torch.zeros_like(loss), loss)

        ctx.label_smoothing, ctx.vocab_size, ctx.real, ctx.chunk_size = label_smoothing, vocab_size, real, chunk_size
        ctx.cap, ctx.gemms = cap, whole_gemms
        if whole:   # d loss_t / d logits_t for every token now, over the logits (the Triton pass) or beside them
            grad_logits = None
            if logits is not None and any(ctx.needs_input_grad[:3]):
                ones = (~ignored).to(torch.float32)
                slope = None if cap is None else _slope(logits, cap)   # before the Triton pass overwrites them
                grad_logits = _chunk_grad(logits, local_target, lse, ones, label_smoothing, vocab_size)
                if slope is not None:
                    grad_logits = grad_logits.mul_(slope)
            del logits
            grad_q = whole_gemms.quantize_grad(grad_logits) if grad_logits is not None else ()
            del grad_logits
            ctx.grad_q_len = len(grad_q)   # none: a shard of padding rows only, or no gradient asked for
            ctx.save_for_backward(hidden, weight, bias, ignored, *grad_q, *(weight_q if grad_q else ()))
        else:
            ctx.save_for_backward(hidden, weight, bias, local_target, ignored, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.chunk_size is None:
            return _whole_backward(ctx, grad_loss)
        hidden, weight, bias, local_target, ignored, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        real = ctx.real
        n = hidden.shape[0]
        w = weight[:real]
        b = bias[:real] if bias is not None else None
        scale = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss).float().contiguous()
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        bias_sum = torch.zeros(real, dtype=torch.float32, device=weight.device) if need_bias else None

        with torch.autocast(hidden.device.type, enabled=False):
            for lo, hi in _chunks(n, ctx.chunk_size) if real > 0 else ():
                logits = _capped(F.linear(hidden[lo:hi], w, b), ctx.cap)
                capped = logits if ctx.cap is None else logits.clone()   # the Triton pass writes over its input
                grad_logits = _uncap_grad(_chunk_grad(logits, local_target[lo:hi], lse[lo:hi], scale[lo:hi],
                                                      ctx.label_smoothing, ctx.vocab_size), capped, ctx.cap)
                del logits, capped
                if grad_hidden is not None:   # need_hidden
                    torch.mm(grad_logits, w, out=grad_hidden[lo:hi])
                if grad_weight is not None:   # the GEMM adds into the weight gradient (beta = 1): no temporary
                    grad_weight[:real].addmm_(grad_logits.t(), hidden[lo:hi])
                if bias_sum is not None:      # need_bias
                    bias_sum += grad_logits.sum(dim=0, dtype=torch.float32)
                del grad_logits
        if grad_bias is not None and bias_sum is not None:   # need_bias
            grad_bias[:real] = bias_sum
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _whole_backward(ctx, grad_loss):
    """The forward made ``D`` = d loss_t / d logits_t for every token (kept by ``ctx.gemms``); the per-token output
    gradient ``g`` scales rows, so it goes on the small sides of the GEMMs: ``grad_hidden = g ⊙ (D W)``,
    ``grad_weight = Dᵀ (g ⊙ hidden)``, ``grad_bias = Dᵀ g``: no second pass over the ``[tokens, V/tp]`` logits. The
    weight gradient is the GEMM's own output where every row of the shard is real (no zero fill, no copy)."""
    hidden, weight, bias, ignored, *kept = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    real, gemms = ctx.real, ctx.gemms
    g = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss).to(torch.float32)[:, None]
    grad_q, weight_q = tuple(kept[:ctx.grad_q_len]), tuple(kept[ctx.grad_q_len:])
    grad_hidden = grad_weight = grad_bias = None
    if not grad_q:   # a shard of padding rows only: no logits, no gradient
        return (torch.zeros_like(hidden) if need_hidden else None), (torch.zeros_like(weight) if need_weight else None), \
            (torch.zeros_like(bias) if need_bias else None), None, None, None, None, None, None, None, None
    with torch.autocast(hidden.device.type, enabled=False):
        if need_hidden:
            grad_hidden = gemms.grad_hidden(grad_q, weight_q, hidden.dtype).to(torch.float32).mul_(g).to(hidden.dtype)
        if need_weight:
            grad_weight = gemms.grad_weight(grad_q, hidden, g)
            if real < weight.shape[0]:   # padding rows: no gradient
                grad_weight = torch.cat([grad_weight, grad_weight.new_zeros(weight.shape[0] - real, weight.shape[1])])
        if need_bias:
            grad_bias = torch.zeros_like(bias)
            grad_bias[:real] = gemms.grad_bias(grad_q, g).to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, label_smoothing: float = 0.0, ignore_index: int = -100,
                         vocab_size: Optional[int] = None, chunk_size: Optional[int] = 4096,
                         group: Optional[dist.ProcessGroup] = None,
                         logit_softcapping: Optional[float] = None,
                         low_precision: Optional[LowPrecisionGemms] = None) -> torch.Tensor:
    """Per-token loss ``vocab_parallel_cross_entropy(F.linear(hidden, weight, bias), target, ...)``
    (shape of ``target``; 0 where ``target == ignore_index``) without the whole logits.

    ``hidden``: ``[..., h]``, the same on every tp rank (already copied / all-gathered for tp: its
    gradient is this rank's partial sum, as ``F.linear``'s). ``weight``: ``[V_padded/tp, h]``, this
    rank's vocabulary rows; ``bias``: ``[V_padded/tp]``. ``vocab_size``: the real vocabulary
    (default: every padded row is real). ``chunk_size``: tokens whose logits exist at once, recomputed in
    the backward; None: the logits whole, once, with their gradient made in the forward over them (one
    GEMM fewer than chunked, one fused pass instead of the unfused path's float32 softmax; the memory of one
    ``[tokens, V/tp]`` logits tensor in the input dtype from the forward to the backward). Under autocast the
    projection runs in the autocast dtype, as ``F.linear`` would. ``logit_softcapping`` c: the loss of
    ``c · tanh(logits / c)`` (Gemma 2's capped logits). ``low_precision``: the three GEMMs through these
    (``quantization.float8_output.Float8OutputLayer``; the whole-logits path only, ``chunk_size=None``).
    """
    group = resolve_group(group)
    world = dist.get_world_size(group)
    padded = weight.shape[0] * world
    vocab_size = padded if vocab_size is None else vocab_size
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer (tokens whose logits exist at once) or None (the "
                         f"logits whole), got {chunk_size!r}.")
    if low_precision is not None and chunk_size is not None:
        raise ValueError(f"the output layer in low precision (Float8Config(output_layer=True)) runs on the "
                         f"whole-logits fused loss, and chunk_size={chunk_size} asks for chunks: set the model's "
                         f"cross_entropy_chunk_size=None, or Float8Config(output_layer=False).")
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded}] (the padded vocabulary "
                         f"over {world} tensor-parallel ranks).")
    if logit_softcapping is not None and not logit_softcapping > 0:
        raise ValueError(f"logit_softcapping must be positive or None, got {logit_softcapping!r}.")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not multiply: "
                         "the weight must be [V/tp, h] with h the hidden states' last dimension.")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} must agree on every "
                         "dimension but the last.")
    check_ids_in_vocab(target, vocab_size, what="label", padded_vocab_size=padded, ignore_index=ignore_index)
    if torch.is_autocast_enabled(hidden.device.type):   # what F.linear would multiply in; the casts stay in autograd
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share a dtype "
                         "(or run under autocast).")
    loss = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1),
                                     float(label_smoothing), ignore_index, vocab_size, chunk_size, group,
                                     logit_softcapping, low_precision)
    return loss.view(target.shape)


def parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                  sequence_parallel: bool, bias: Optional[torch.Tensor] = None,
                                  **kwargs) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(parallel_logits(hidden, weight, sequence_parallel, bias), target)``
    chunked: ``hidden`` ``[s(/tp), b, h]`` is all-gathered along the sequence (sequence parallel) or
    copied to the tp region first, so its gradient is reduce-scattered / all-reduced over tp exactly as
    on the unfused path; ``target`` ``[s, b]``; ``kwargs`` as :func:`linear_cross_entropy`."""
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        hidden = copy_to_tensor_parallel_region(hidden)
    return linear_cross_entropy(hidden, weight, target, bias=bias, **kwargs)
