"""What the SwiGLU/GeGLU tests on the CPU (tests/unit/ops/test_swiglu.py) and on a GPU (tests/gpu/test_swiglu_gpu.py)
share: the torch expressions, the inputs, and one forward + backward."""

import torch
import torch.nn.functional as F

from lightning_megatron.ops import swiglu as gated

REFERENCE = {"swiglu": lambda gate, up: F.silu(gate) * up,
             "geglu": lambda gate, up: F.gelu(gate, approximate="tanh") * up}
FUNCTIONS = {"swiglu": gated.swiglu, "geglu": gated.geglu}


def inputs(shape, dtype, seed=0, device="cpu"):
    """``h [.., 2F]`` (spread x3, so the activations' curved parts are hit) and an output gradient ``[.., F]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = (torch.randn(shape, device=device, generator=gen) * 3).to(dtype)
    grad = torch.randn(shape[:-1] + (shape[-1] // 2,), device=device, generator=gen).to(dtype)
    return h, grad


def forward_backward(fn, h0, grad, dtype=None):
    """(output, gradient of h) of ``fn``; ``dtype``: computed from float64 copies, then rounded to it."""
    h = (h0.double() if dtype is not None else h0).detach().clone().requires_grad_()
    out = fn(h)
    out.backward(grad.double() if dtype is not None else grad)
    if dtype is not None:
        return out.detach().to(dtype), h.grad.to(dtype)
    return out.detach(), h.grad


def reference(activation):
    """``h -> act(gate) * up``, the torch expression of ``activation``."""
    def fn(h):
        gate, up = h.chunk(2, dim=-1)
        return REFERENCE[activation](gate, up)
    return fn
