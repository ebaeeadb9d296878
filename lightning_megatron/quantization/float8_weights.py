"""A float8 linear's weight cast once per schedule (tensorwise), not in every micro-batch's forward and backward.

torchao's float8 linear (``matmul_with_hp_or_float8_args``) casts the weight to float8 in each forward and again
in each backward: at the Llama-3-8B layer shape (8 layers, four micro-batches a step) that is ~70 GB of memory
traffic a step, ~20 ms on an H200. The weight does not change between the micro-batches of a step, so each weight
is cast once per schedule (:meth:`Float8WeightCast.refresh`), in the two layouts its GEMMs read (``W`` for the
forward, ``Wᵀ`` for the input gradient), and the layers use those casts until the schedule ends, as Transformer
Engine's ``is_first_microbatch`` caching does. Memory: two bytes per weight element of every converted linear.

When: the step engine arms the casts for a schedule and marks them stale (:func:`armed_weight_casts`); a layer's
casts are made in a forward pre-hook of the module that owns them (the transformer layer, whose ``__call__`` stays
eager when its bodies are compiled; :func:`install_refresh_hooks`), at its first forward of the schedule. The
parameters are current there: the distributed optimizer's overlapped all-gather waits in a pre-hook of the same
module that runs before every other (``distributed/param_buffer.py``), so a cast is never made from a weight whose
gather is still in flight.

Numerically this is torchao's tensorwise float8 linear, bit for bit: the same casts (torchao's own scale and
saturation functions), of the same tensors, into the same GEMMs on the same layouts (``torch._scaled_mm``, fast
accumulation in the forward only; torchao's emulation with ``emulate=True``). The casts are rewritten in place, so
CUDA graphs captured around the layers keep reading the same memory; a layer called outside a schedule (the user's
own forward), or multiplying a tensor that is not its own weight (a gathered one), casts as torchao does.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed.param_buffer import waits_as_one

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _to_float8(x: torch.Tensor, dtype: torch.dtype, pow2: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``dtype`` with its tensorwise dynamic scale, and the scale, exactly as torchao casts it
    (``hp_tensor_to_float8_dynamic``: ``tensor_to_scale``, then ``x.float() * scale`` saturated)."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(x, dtype, round_scales_to_power_of_2=pow2)
    return to_fp8_saturated(x.to(torch.float32) * scale, dtype), scale


def _mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
        fast_accum: bool, emulate: bool) -> torch.Tensor:
    """``a @ b`` of float8 operands as torchao's float8 ``mm`` runs it: emulated on the operands as they are, else
    ``torch._scaled_mm`` on ``a`` made row-major and ``b`` column-major (no copy where they already are)."""
    from torchao.float8.float8_utils import is_row_major

    if emulate:
        return torch.mm(a.float() / a_scale, b.float() / b_scale).to(out_dtype)
    if not is_row_major(a.stride()):
        a = a.contiguous()
    if is_row_major(b.stride()):
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _refresh(weight: torch.Tensor, data: torch.Tensor, data_t: Optional[torch.Tensor], scale: torch.Tensor,
             pow2: bool) -> None:
    """Write ``weight``'s float8 cast into ``data`` (its layout) and ``data_t`` (transposed; None: not that one),
    its scale into ``scale``: one pass over the weight when compiled."""
    cast, s = _to_float8(weight, E4M3, pow2)
    data.copy_(cast)
    if data_t is not None:
        data_t.copy_(cast.t())
    scale.copy_(s)


def compiled_for_shape(fn: Callable, name: str) -> Callable:
    """``fn`` ``torch.compile``d under its own code object named ``name``: its own compile cache (static shapes;
    a model's many layer shapes do not add up against dynamo's recompile limit, past which it would silently
    fall back to eager)."""
    if sys.version_info >= (3, 11):   # code objects have a qualified name since 3.11
        code = fn.__code__.replace(co_name=name, co_qualname=name)
    else:
        code = fn.__code__.replace(co_name=name)
    return torch.compile(types.FunctionType(code, fn.__globals__, name, None, fn.__closure__), dynamic=False)


@functools.lru_cache(maxsize=None)
def _compiled_refresh(shape: Tuple[int, ...], transposed: bool) -> Callable[..., None]:
    """:func:`_refresh` compiled for one weight shape, writing the transposed cast or not."""
    name = "float8_weight_cast_" + "_".join(map(str, shape)) + ("" if transposed else "_forward_only")
    return compiled_for_shape(_refresh, name)


class Float8WeightCast:
    """The weight of ``linear`` in float8 for the schedule that runs now: ``data [out, in]`` and ``data_t [in, out]``
    (row-major each), and its scale. ``armed`` while a schedule runs (set by :func:`armed_weight_casts`);
    ``stale`` until the owner's pre-hook has cast the weight for it; ``forward_only`` for a schedule without
    backward (evaluation), whose casts skip ``data_t`` (only the input gradient reads it); ``graphed`` for a schedule
    run in CUDA graphs (its host work is not replayed, so a column-parallel linear may call its float8 GEMMs one at a
    time, see ``Float8Matmul.split_gemms``). The layer uses the casts only when armed and not stale (:meth:`ready`).
    The weight is read from the layer at each cast (a parameter replaced after ``enable_fp8`` is the one cast)."""

    def __init__(self, linear: nn.Module, pow2: bool = False, compiled: bool = True) -> None:
        self.linear, self.pow2, self.compiled = linear, pow2, compiled
        self.armed = False
        self.stale = True
        self.forward_only = False
        self.graphed = False
        self.data: Optional[torch.Tensor] = None
        self.data_t: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None

    def refresh(self, transposed: bool = True) -> None:
        """Cast the weight as it is now, into the same buffers each time (allocated at the first call); ``data_t``
        too unless not ``transposed``."""
        weight = self._weight()
        if self.data is None or self.data.shape != weight.shape or self.data.device != weight.device:
            rows, cols = weight.shape
            self.data = torch.empty(rows, cols, dtype=E4M3, device=weight.device)
            self.data_t = torch.empty(cols, rows, dtype=E4M3, device=weight.device)
            self.scale = torch.empty((), dtype=torch.float32, device=weight.device)
        assert self.data_t is not None and self.scale is not None
        refresh = _compiled_refresh(tuple(weight.shape), transposed) if self.compiled and weight.is_cuda else _refresh
        with torch.no_grad():
            refresh(weight, self.data, self.data_t if transposed else None, self.scale, self.pow2)

    def _weight(self) -> torch.Tensor:
        weight = self.linear.weight
        assert isinstance(weight, torch.Tensor), type(weight)
        return weight.detach()

    def ready(self) -> bool:
        """Whether the casts hold the weight as it is for this schedule."""
        return self.armed and not self.stale

    def __repr__(self) -> str:
        return f"Float8WeightCast({tuple(self._weight().shape)}, armed={self.armed}, stale={self.stale})"


def cached_forward(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, pow2: bool,
                   emulate: bool) -> torch.Tensor:
    """``x @ Wᵀ`` from ``W``'s cast (``data``, ``scale``): ``x`` cast to e4m3, fast accumulation (torchao's forward)."""
    x8, x_scale = _to_float8(x, E4M3, pow2)
    out = _mm(x8.reshape(-1, x.shape[-1]), x_scale, data.t(), scale, x.dtype, True, emulate)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def cast_output_grad(grad: torch.Tensor, pow2: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output gradient as both backward GEMMs read it: ``[tokens, out]`` in e5m2, and its scale."""
    return _to_float8(grad.reshape(-1, grad.shape[-1]), E5M2, pow2)


def cached_input_grad(grad: torch.Tensor, data: torch.Tensor, data_t: torch.Tensor, scale: torch.Tensor,
                      pow2: bool, emulate: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dX = dY @ W`` (shaped as ``dY`` with ``W``'s input features), and ``dY``'s cast for the weight gradient."""
    g8, g_scale = cast_output_grad(grad, pow2)
    w = data if emulate else data_t.t()   # column-major W is the cached Wᵀ, row-major (torchao's emulation
    grad_x = _mm(g8, g_scale, w, scale, grad.dtype, False, emulate)   # multiplies W in its own layout)
    return grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1]), g8, g_scale


def cached_weight_grad(g8: torch.Tensor, g_scale: torch.Tensor, x: torch.Tensor, pow2: bool, emulate: bool,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """``dW = dYᵀ @ x`` from ``dY``'s cast, ``x`` cast again (as torchao's backward)."""
    x8, x_scale = _to_float8(x.reshape(-1, x.shape[-1]), E4M3, pow2)
    return _mm(g8.t(), g_scale, x8, x_scale, out_dtype, False, emulate)


@functools.lru_cache(maxsize=None)
def compiled_piece(fn: Callable, shapes: Tuple[Tuple[int, ...], ...]) -> Callable:
    """One of the cached path's pieces above compiled for these operand shapes (its casts fused; GPUs)."""
    return compiled_for_shape(fn, fn.__name__ + "_" + "_".join("x".join(map(str, s)) for s in shapes))


class _CachedWeightFloat8Linear(torch.autograd.Function):
    """``x @ weightᵀ`` with ``weight`` already in float8 (both layouts): torchao's tensorwise
    ``matmul_with_hp_or_float8_args`` without its two weight casts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, data: torch.Tensor, data_t: torch.Tensor,
                scale: torch.Tensor, pow2: bool, emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(x, data, data_t, scale)
        ctx.pow2, ctx.emulate, ctx.weight_dtype = pow2, emulate, weight.dtype
        return cached_forward(x, data, scale, pow2, emulate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, data, data_t, scale = ctx.saved_tensors
        pow2, emulate = ctx.pow2, ctx.emulate
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x, g8, g_scale = cached_input_grad(grad, data, data_t, scale, pow2, emulate)
        else:
            g8, g_scale = cast_output_grad(grad, pow2)
        if ctx.needs_input_grad[1]:
            grad_w = cached_weight_grad(g8, g_scale, x, pow2, emulate, grad.dtype).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None


def cached_float8_linear(x: torch.Tensor, weight: torch.Tensor, data: torch.Tensor, data_t: torch.Tensor,
                         scale: torch.Tensor, pow2: bool, emulate: bool) -> torch.Tensor:
    """``x @ weightᵀ`` in float8 from ``weight``'s casts (``data``, ``data_t``, ``scale`` of an armed
    :class:`Float8WeightCast`); the gradient reaches ``weight``."""
    return _CachedWeightFloat8Linear.apply(x, weight, data, data_t, scale, pow2, emulate)


def float8_weight_casts(module: nn.Module) -> List[Float8WeightCast]:
    """Every :class:`Float8WeightCast` of ``module``'s float8 linears (``enable_fp8`` made them)."""
    return [cast for m in module.modules() for cast in [_cast_of(m)] if cast is not None]


def _cast_of(module: nn.Module) -> Optional[Float8WeightCast]:
    cast = getattr(getattr(module, "float8", None), "weight_cast", None)
    return cast if isinstance(cast, Float8WeightCast) else None


def _owners(root: nn.Module) -> Dict[nn.Module, List[Float8WeightCast]]:
    """The module whose pre-hook makes each cast: the outermost one that waits for its parameters as one
    (``waits_as_one``, the overlapped gathers' rule), else the linear itself."""
    owners: Dict[nn.Module, List[Float8WeightCast]] = {}
    claimed: set = set()
    for module in root.modules():   # parents before their children
        if id(module) in claimed:
            continue
        as_one = waits_as_one(module)
        casts = float8_weight_casts(module) if as_one else [c for c in [_cast_of(module)] if c is not None]
        if as_one:
            claimed.update(id(m) for m in module.modules())
        if casts:
            owners[module] = casts
    return owners


def install_refresh_hooks(root: nn.Module) -> List[Any]:
    """A forward pre-hook on every owner of casts in ``root`` that casts its stale armed weights; returns the hook
    handles (``remove()`` each to take them off)."""
    handles = []
    for owner, casts in _owners(root).items():
        handles.append(owner.register_forward_pre_hook(_refresher_hook(casts)))
    return handles


def _refresher_hook(casts: List[Float8WeightCast]) -> Callable[..., None]:
    @torch._dynamo.disable   # a hook traced with its module (module.compile()) runs eagerly: the flags are host state
    def cast_stale_weights(module: nn.Module, args: Any) -> None:
        for cast in casts:
            if cast.armed and cast.stale:
                cast.refresh(transposed=not cast.forward_only)
                cast.stale = False
    return cast_stale_weights


@contextlib.contextmanager
def armed_weight_casts(casts: Sequence[Float8WeightCast], forward_only: bool = False,
                       graphed: bool = False) -> Iterator[None]:
    """Let the layers use their weights' casts for one schedule (the weights do not change inside it): each is made
    by its owner's pre-hook at the owner's first forward (:func:`install_refresh_hooks`); for a ``forward_only``
    schedule in the forward GEMM's layout only; ``graphed``: the schedule runs in CUDA graphs."""
    for cast in casts:
        cast.armed, cast.stale, cast.forward_only, cast.graphed = True, True, forward_only, graphed
    try:
        yield
    finally:
        for cast in casts:
            cast.armed = False


@contextlib.contextmanager
def ready_for_capture(casts: Sequence[Float8WeightCast]) -> Iterator[None]:
    """While per-layer CUDA graphs are captured (their pieces run without the owners' pre-hooks): the layers take
    the cached path, reading the cast buffers, which the pre-hooks refresh in place before each step's replays.
    Buffers never filled are filled now (their values do not matter to the capture)."""
    stale = [cast.stale for cast in casts]
    for cast in casts:
        if cast.data is None:
            cast.refresh()
        cast.stale = False
    try:
        yield
    finally:
        for cast, was in zip(casts, stale):
            cast.stale = was


__all__ = ["Float8WeightCast", "armed_weight_casts", "cached_float8_linear", "cached_forward", "cached_input_grad",
           "cached_weight_grad", "cast_output_grad", "compiled_piece", "float8_weight_casts", "install_refresh_hooks",
           "ready_for_capture"]
