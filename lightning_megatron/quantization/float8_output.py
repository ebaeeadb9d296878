"""The output layer's three GEMMs in float8 (``Float8Config(output_layer=True)``), inside the fused loss.

At a 128k vocabulary the output projection is a large share of a model's linear FLOPs (23% at the Llama-3-8B
layer shape with 8 layers), and torchao's ``Float8Linear`` cannot reach it: the GEMM lives inside the fused
linear + cross-entropy (``tensor_parallel/fused_cross_entropy.py``), which makes the logits' gradient ``D`` in
its forward. :class:`Float8OutputLayer` gives that function its GEMMs in float8, tensorwise, as torchao's
tensorwise recipe does for a linear:

- forward ``logits = hidden @ Wᵀ``: ``hidden`` and ``W`` in e4m3, each with one dynamic scale (its amax),
  fast accumulation (torchao's setting for the output GEMM).
- ``grad_weight = Dᵀ @ (g ⊙ hidden)``: ``D`` in e5m2 with a static scale of 2¹⁵: every entry of
  ``D = softmax - (1-α)·onehot - α/V`` (times the soft-cap's slope, at most 1) lies in [-1, 1], so no amax pass
  is needed and nothing overflows (e5m2 holds 57344); the per-token output gradient ``g`` goes on the small side,
  cast to e4m3 with its own dynamic scale.
- ``grad_hidden = D @ W`` stays in the input dtype, from ``D`` unrounded: it is the gradient the whole model
  below learns from, and with ``D`` rounded to e5m2 there (two mantissa bits: the same ~12% error on every token
  whose softmax is alike, a bias, not noise) GPT-1.3B's loss left the unigram plateau 30-100+ steps after bf16 in
  all five such runs (`benchmarks/RESULTS.md`, sixteenth session), and on time in both that kept it in bf16.
  So ``D`` is kept until the backward in the input dtype (as the bf16 path keeps it) and, for the weight
  gradient, in float8 transposed: half as much again.

``torch._scaled_mm`` on Hopper contracts both operands along their rows: ``grad_weight`` needs ``D`` and
``hidden`` transposed. Each cast writes the layout its GEMM reads in the same pass (``torch.compile``d on CUDA
with ``Float8Config(compile=True)``, the default: inductor tiles the transposed stores); a separate
``.t().contiguous()`` of a float8 tensor is a slow strided copy (6.4 ms for ``D`` at 8192 tokens x 128256 on an
H200, more than the float8 GEMM saves). Off by default, as in
Megatron-Core and torchtitan, which keep the output layer in high precision for accuracy: turn it on where
the loss curve says it is safe (``benchmarks/bench_fp8.py`` compares curves). The unfused path (no labels, or
``fused_cross_entropy=False``) runs the projection through torchao's float8 linear (``float8.Float8Matmul``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..tensor_parallel.fused_cross_entropy import INPUT_DTYPE_GEMMS

ALIGNMENT = 16            # float8 GEMMs (torch._scaled_mm) need multiples of 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD_SCALE = 2.0 ** 15   # |D| <= 1: D * 2^15 <= 32768 < 57344, e5m2's largest value

Quantized = Tuple[torch.Tensor, torch.Tensor]   # (float8 values, the float32 scalar that dequantizes them)


def _scaled(x: torch.Tensor, dtype: torch.dtype, pow2: bool,
            row_scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (times ``row_scale``) in float32 times its tensorwise scale ``finfo.max / amax``, clamped, and
    ``1 / scale``."""
    x = x.to(torch.float32)
    if row_scale is not None:
        x = x * row_scale
    from torchao.float8.float8_utils import amax_to_scale   # torchao's: float64 division, alike eager and compiled

    scale = amax_to_scale(torch.linalg.vector_norm(x, ord=float("inf")), dtype, pow2)
    limit = torch.finfo(dtype).max
    return (x * scale).clamp(-limit, limit), scale.reciprocal()


def cast_to_float8(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> Quantized:
    """``x`` in ``dtype`` with one dynamic tensorwise scale ``finfo.max / amax`` (rounded down to a power of 2
    with ``pow2``); returns the values and ``1 / scale``."""
    scaled, inverse = _scaled(x, dtype, pow2)
    return scaled.to(dtype), inverse


def cast_transposed_to_float8(x: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype,
                              pow2: bool = False) -> Quantized:
    """``(row_scale ⊙ x)ᵀ`` made contiguous, in ``dtype`` with its dynamic tensorwise scale, and ``1 / scale``."""
    scaled, inverse = _scaled(x, dtype, pow2, row_scale)
    return scaled.to(dtype).t().contiguous(), inverse


def cast_grad_to_float8(d: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The logits' gradient ``d [t, v]`` (every entry in [-1, 1]) transposed ``[v, t]`` (as ``grad_weight``
    reads it) in e5m2 with the static scale ``GRAD_SCALE``, and ``1 / GRAD_SCALE``."""
    inverse = torch.full((), 1.0 / GRAD_SCALE, dtype=torch.float32, device=d.device)
    return (d.to(torch.float32) * GRAD_SCALE).to(E5M2).t().contiguous(), inverse


def scaled_mm(a: Quantized, b_t: Quantized, out_dtype: torch.dtype, fast_accum: bool,
              emulate: bool = False) -> torch.Tensor:
    """``a @ b_tᵀ`` dequantized: ``a [m, k]`` and ``b_t [n, k]`` row-major float8 (``b_t.t()`` is the
    column-major operand ``torch._scaled_mm`` wants). ``emulate``: the float8 values dequantized and multiplied in
    float32 (torchao's emulation: any device, no float8 GEMM)."""
    if emulate:
        return ((a[0].to(torch.float32) * a[1]) @ (b_t[0].to(torch.float32) * b_t[1]).t()).to(out_dtype)
    return torch._scaled_mm(a[0], b_t[0].t(), scale_a=a[1], scale_b=b_t[1], out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class Float8OutputLayer:
    """A language model's output projection in float8 (what :func:`enable_fp8` puts in ``GPTModel.output_float8``
    with ``Float8Config(output_layer=True)``). Called as ``(hidden, weight, bias)`` it is the unfused projection
    (torchao's float8 linear); the fused loss calls :meth:`forward`, :meth:`grad_hidden` and :meth:`grad_weight`."""

    def __init__(self, name: str, unfused: Callable[..., torch.Tensor], compile: bool = True,
                 pow2: bool = False, emulate: bool = False) -> None:
        """``unfused(x, weight, bias)``: the float8 projection of the unfused path (``float8.Float8Matmul``);
        ``compile``: the casts compiled; ``pow2``: dynamic scales rounded down to powers of 2; ``emulate``: float8
        values multiplied in float32 (``Float8Config(emulate=True)``: GPUs without float8 GEMMs)."""
        self.name, self.unfused, self.compile, self.pow2, self.emulate = name, unfused, compile, pow2, emulate

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.unfused(x, weight, bias)

    def __repr__(self) -> str:
        return "tensorwise output layer" + (" (emulated)" if self.emulate else "")

    def check_shapes(self, tokens: int, rows: int, hidden: int) -> None:
        """Float8 GEMMs need every dimension a multiple of 16: this rank's vocabulary rows, the hidden size and
        the tokens (``rows`` 0: a shard of padding rows only, which multiplies nothing)."""
        if rows and (tokens % ALIGNMENT or rows % ALIGNMENT or hidden % ALIGNMENT):
            raise ValueError(
                f"{self.name}: Float8Config(output_layer=True) multiplies [{tokens} tokens x {hidden}] by "
                f"[{rows} vocabulary rows on this rank x {hidden}] in float8, and float8 GEMMs need every dimension "
                f"to be a multiple of {ALIGNMENT}: use a batch size x sequence length and a vocabulary (per "
                f"tensor-parallel rank) that are, or Float8Config(output_layer=False).")

    def _cast(self, role: str) -> Callable[..., Any]:
        return _casts(self.compile)[role]

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """``hidden [t, h] @ weight [v, h]ᵀ (+ bias)`` in float8 → (logits in ``hidden``'s dtype, ``(weight,)`` as
        ``grad_hidden`` reads it: in its own dtype)."""
        logits = scaled_mm(self._cast("rows")(hidden, E4M3, self.pow2), self._cast("rows")(weight, E4M3, self.pow2),
                           hidden.dtype, fast_accum=True, emulate=self.emulate)
        return (logits if bias is None else logits + bias), (weight,)

    def quantize_grad(self, grad_logits: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``D`` as ``(D [t, v] as it is, d8ᵀ [v, t] in e5m2, 1 / scale)``."""
        return (grad_logits, *self._cast("grad")(grad_logits))

    def grad_hidden(self, grad_q: Tuple[torch.Tensor, ...], weight_q: Tuple[torch.Tensor, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        """``D @ W`` [t, h] as the input-dtype path makes it (see the module's docstring: not float8)."""
        return INPUT_DTYPE_GEMMS.grad_hidden(grad_q[:1], weight_q, dtype).to(dtype)

    def grad_weight(self, grad_q: Tuple[torch.Tensor, ...], hidden: torch.Tensor,
                    row_scale: torch.Tensor) -> torch.Tensor:
        """``Dᵀ @ (row_scale ⊙ hidden)`` [v, h] in ``hidden``'s dtype."""
        _, d8_t, d_inverse = grad_q
        scaled_t = self._cast("transposed")(hidden, row_scale, E4M3, self.pow2)
        return scaled_mm((d8_t, d_inverse), scaled_t, hidden.dtype, fast_accum=False, emulate=self.emulate)

    def grad_bias(self, grad_q: Tuple[torch.Tensor, ...], row_scale: torch.Tensor) -> torch.Tensor:
        """``Dᵀ @ row_scale`` [v] in float32, from ``D`` unrounded, as the input-dtype path makes it."""
        return INPUT_DTYPE_GEMMS.grad_bias(grad_q[:1], row_scale)


_CASTS: Dict[bool, Dict[str, Callable[..., Any]]] = {}


def _casts(compiled: bool) -> Dict[str, Callable[..., Any]]:
    """The casts, eager or ``torch.compile``d (each one kernel reading and writing once; automatic dynamic
    shapes: ``"rows"`` casts both the hidden states and the weight, so it compiles once more, shape-generic, and a
    new token count compiles nothing new)."""
    if compiled not in _CASTS:
        casts: Dict[str, Callable[..., Any]] = {"rows": cast_to_float8,
                                                "transposed": cast_transposed_to_float8, "grad": cast_grad_to_float8}
        if compiled:
            casts = {role: torch.compile(fn) for role, fn in casts.items()}
        _CASTS[compiled] = casts
    return _CASTS[compiled]


__all__ = ["Float8OutputLayer", "cast_grad_to_float8", "cast_to_float8", "cast_transposed_to_float8", "scaled_mm"]
