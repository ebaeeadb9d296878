"""Fused Triton kernels for the gated MLP activations, SwiGLU and GeGLU, forward and backward.

fc1's output ``h [.., 2F]`` holds the gate ``h[.., :F]`` and the up projection ``h[.., F:]``; the activation is
``out = act(gate) · up`` with ``act`` SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma). Inductor compiles
the torch expression ``gate, up = h.chunk(2, -1); act(gate) * up`` well forward, but its backward, whose result
is ``cat([d_gate, d_up], -1)``, computes the two halves in separate loops, each reading ``gate``, ``up`` and
``grad_out`` again: five reads and two writes of ``T × F`` where three reads and two writes suffice (19.1 ms
against ~12.5 ms of bytes per step for a Llama-3-8B-shape layer at sequence 4096 on an H200). Here:

- forward: one program per (row, block of ``BLOCK`` columns) reads ``gate`` and ``up`` once and writes
  ``act(gate) · up``, computed in float32 and rounded once to ``h``'s dtype;
- backward: one program per (row, column block) reads ``gate``, ``up`` and ``grad_out`` once and writes both
  halves of one new ``[.., 2F]`` gradient: ``d_gate = g · up · act'(gate)`` into columns ``[0, F)`` and
  ``d_up = g · act(gate)`` into ``[F, 2F)``, in float32, each rounded once.

SiLU: ``act = x·σ(x)``, ``act' = σ(x)·(1 + x·(1 - σ(x)))`` (torch's ``silu_backward``). GELU (tanh): with
``v = 2·√(2/π)·(x + 0.044715·x³)``, ``0.5·x·(1 + tanh(v/2)) = x·σ(v)``, so ``act = x·σ(v)`` and
``act' = σ(v) + x·σ(v)·(1 - σ(v))·2·√(2/π)·(1 + 3·0.044715·x²)`` (torch's formula with ``1 ± tanh`` written
through σ). ``1 - σ(v)`` is computed as ``σ(-v)``: subtracted from 1 it cancels where ``σ(v)`` nears 1, which
made torch's float32 GeGLU backward (and inductor's) ~5e-5 off at gradients ~10; here it is within ~1e-6
relative of a float64 evaluation.

The kernels are custom operators (``torch.library.custom_op``; their backward is one too, registered with
``register_autograd``), so ``torch.compile`` keeps them inside a compiled layer without a graph break, calling
them with the real tensors (see the note at their registration: why not ``triton_op``). Measured on an H200
(torch 2.11, bf16, T = 16384, F = 14336, fwd + bwd of a compiled function): backward 0.57 ms (96% of the bytes
at 4.3 TB/s) against inductor's 0.93 ms; forward 0.34 ms against inductor's 0.32 (block sizes 512 to 4096 and 4
to 16 warps all within 1%); through the Trainer at the Llama-3-8B layer shape, 816.7 against 819.9 ms a step
with ``LM_SWIGLU_KERNELS=0``. Triton is imported here only: on CPU installs without it, on CPU tensors, for
other dtypes and with ``LM_SWIGLU_KERNELS=0`` (or inside ``with kernels_enabled(False):``)
:func:`swiglu` and :func:`geglu` are the torch expressions (tests compare the two).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .switch import KernelSwitch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the torch expressions
    triton = None

ENV = "LM_SWIGLU_KERNELS"
SWITCH = KernelSwitch(ENV)
kernels_enabled = SWITCH.forced_to   # ``with kernels_enabled(False):`` the torch expressions
BLOCK = 1024                         # columns of F one program holds
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def torch_swiglu(h: Tensor) -> Tensor:
    """The torch expression: ``silu(gate) * up`` of ``h = [gate, up]`` (last dimension)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_geglu(h: Tensor) -> Tensor:
    """The torch expression: ``gelu_tanh(gate) * up`` of ``h = [gate, up]`` (last dimension)."""
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def kernels_run(h: Tensor) -> bool:
    """Whether ``h`` takes the kernels: Triton importable, a non-empty CUDA tensor of a float dtype they take
    (its last dimension even), the switch on."""
    return (triton is not None and h.is_cuda and h.dtype in DTYPES and h.numel() > 0 and h.shape[-1] % 2 == 0
            and SWITCH.on())


if triton is not None:

    @triton.jit
    def _gate_and_up(h_ptr, ffn, stride_h, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """This program's row, its block of columns and their mask, the row's gate and up there (float32) and the
        activation's argument ``v`` (the gate for SiLU, ``2·√(2/π)·(x + 0.044715·x³)`` for tanh GELU), with
        ``h``'s rows ``stride_h`` apart (its columns contiguous)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < ffn
        h_row = h_ptr + row * stride_h
        gate = tl.load(h_row + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(h_row + ffn + cols, mask=inside, other=0.0).to(tl.float32)
        if GELU:   # 2·√(2/π) = 1.5957691216057308
            v = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        else:
            v = gate
        return row, cols, inside, gate, up, v

    @triton.jit
    def _forward_kernel(h_ptr, out_ptr, ffn, stride_h, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """out[t, f] = act(h[t, f]) · h[t, ffn + f] for the columns of one block of one row; ``out`` is
        ``[T, ffn]`` contiguous."""
        row, cols, inside, gate, up, v = _gate_and_up(h_ptr, ffn, stride_h, GELU, BLOCK)
        out = gate * tl.sigmoid(v) * up
        tl.store(out_ptr + row * ffn + cols, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _backward_kernel(h_ptr, grad_ptr, dh_ptr, ffn, stride_h, stride_g, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """dh[t, f] = g · up · act'(gate) and dh[t, ffn + f] = g · act(gate) for one block of one row, with
        gate = h[t, f], up = h[t, ffn + f], g = grad[t, f]; ``dh`` is ``[T, 2·ffn]`` contiguous."""
        row, cols, inside, gate, up, v = _gate_and_up(h_ptr, ffn, stride_h, GELU, BLOCK)
        g = tl.load(grad_ptr + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
        sig = tl.sigmoid(v)
        rest = tl.sigmoid(-v)   # 1 - σ(v) without cancelling where σ(v) nears 1 (no NaN where exp overflows)
        if GELU:
            slope = sig + gate * sig * rest * (1.5957691216057308 * (1.0 + 0.134145 * gate * gate))
        else:
            slope = sig * (1.0 + gate * rest)
        d_gate = g * up * slope
        d_up = g * (gate * sig)
        dh_row = dh_ptr + row * (2 * ffn)
        tl.store(dh_row + cols, d_gate.to(dh_ptr.dtype.element_ty), mask=inside)
        tl.store(dh_row + ffn + cols, d_up.to(dh_ptr.dtype.element_ty), mask=inside)


def _rows(x: Tensor, width: int) -> Tensor:
    """``x`` as ``[rows, width]`` with contiguous columns (a view where it can be)."""
    x = x.reshape(-1, width)
    return x if x.stride(1) == 1 else x.contiguous()


def _run_forward(h: Tensor, gelu: bool) -> Tensor:
    ffn = h.shape[-1] // 2
    h2 = _rows(h, 2 * ffn)
    rows = h2.shape[0]
    out = torch.empty((rows, ffn), dtype=h.dtype, device=h.device)
    _forward_kernel[(rows, triton.cdiv(ffn, BLOCK))](h2, out, ffn, h2.stride(0), GELU=gelu, BLOCK=BLOCK, num_warps=4)
    return out.view(h.shape[:-1] + (ffn,))


def _run_backward(h: Tensor, grad: Tensor, gelu: bool) -> Tensor:
    ffn = h.shape[-1] // 2
    h2, g2 = _rows(h, 2 * ffn), _rows(grad, ffn)
    rows = h2.shape[0]
    dh = torch.empty((rows, 2 * ffn), dtype=h.dtype, device=h.device)
    _backward_kernel[(rows, triton.cdiv(ffn, BLOCK))](h2, g2, dh, ffn, h2.stride(0), g2.stride(0), GELU=gelu,
                                                      BLOCK=BLOCK, num_warps=4)
    return dh.view(h.shape)


# Opaque custom operators (``torch.library.custom_op``), not ``triton_op``: inductor calls them with the real tensors,
# so the kernels read every stride at run time. Traced into inductor's graph (``triton_op``), the strides were the
# trace's and inductor could lay the buffers out otherwise: on an H200 (torch 2.11) it padded the rows of the
# backward's ``[T, 2F]`` output (F = 1000: 2000 -> 2016 columns) after the kernel had been given 2000, and the
# compiled gradient was garbage (tests/gpu/test_swiglu_gpu.py). Registered wherever Triton imports (~10 ms; a
# ``triton_op`` pulled in much of torch's compiler at import), so the CPU tests run them under Triton's interpreter.
if triton is not None:

    @torch.library.custom_op("lightning_megatron::gated_activation", mutates_args=())
    def _gated_activation(h: Tensor, gelu: bool) -> Tensor:
        """``act(h[.., :F]) · h[.., F:]``: ``[.., F]`` in ``h``'s dtype."""
        return _run_forward(h, gelu)

    @_gated_activation.register_fake
    def _(h: Tensor, gelu: bool) -> Tensor:
        return h.new_empty(h.shape[:-1] + (h.shape[-1] // 2,))

    @torch.library.custom_op("lightning_megatron::gated_activation_backward", mutates_args=())
    def _gated_activation_backward(h: Tensor, grad: Tensor, gelu: bool) -> Tensor:
        """The gradient of ``h`` for the output gradient ``grad [.., F]``: ``[.., 2F]`` in ``h``'s dtype."""
        return _run_backward(h, grad, gelu)

    @_gated_activation_backward.register_fake
    def _(h: Tensor, grad: Tensor, gelu: bool) -> Tensor:
        return h.new_empty(h.shape)

    def _setup_context(ctx, inputs, output) -> None:
        h, gelu = inputs
        ctx.save_for_backward(h)
        ctx.gelu = gelu

    def _backward(ctx, grad: Tensor):
        (h,) = ctx.saved_tensors
        return _gated_activation_backward(h, grad, ctx.gelu), None

    _gated_activation.register_autograd(_backward, setup_context=_setup_context)


def kernel_swiglu(h: Tensor) -> Tensor:
    """SwiGLU through the Triton kernels (CUDA tensors, Triton installed)."""
    return _gated_activation(h, False)


def kernel_geglu(h: Tensor) -> Tensor:
    """GeGLU (tanh GELU) through the Triton kernels (CUDA tensors, Triton installed)."""
    return _gated_activation(h, True)


def implementation(h: Tensor, activation: str = "swiglu") -> Callable[[Tensor], Tensor]:
    """The function that computes ``activation`` (``"swiglu"`` or ``"geglu"``) of ``h``: the kernel's where
    :func:`kernels_run`, else the torch expression."""
    if kernels_run(h):
        return kernel_geglu if activation == "geglu" else kernel_swiglu
    return torch_geglu if activation == "geglu" else torch_swiglu


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``h = [gate, up]`` (last dimension, ``2F`` wide): ``[.., F]``."""
    return implementation(h, "swiglu")(h)


def geglu(h: Tensor) -> Tensor:
    """``gelu_tanh(gate) * up`` of ``h = [gate, up]`` (last dimension, ``2F`` wide): ``[.., F]``."""
    return implementation(h, "geglu")(h)
