"""Global-norm clipping of bf16 gradients: the norm is exact in float32, the scaling one foreach pass."""

import torch

from lightning_megatron.distributed import clip_grad_norm, global_grad_norm
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks


def _clip_bf16():
    state = ParallelState(ParallelLayout(1)).activate()
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (4096, 300, 7)]
    params.append(torch.nn.Parameter(torch.zeros(5)))             # a float32 one in the same model
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 3).to(p.dtype)
    grads = [p.grad.clone() for p in params]
    exact = torch.cat([g.double().flatten() for g in grads]).norm()
    norm = global_grad_norm(params, state)
    total = clip_grad_norm(params, 1.0, state)
    coefficient = torch.clamp(1.0 / (total + 1e-6), max=1.0)
    state.destroy()
    return float(exact), float(norm), float(total), grads, [p.grad for p in params], coefficient


def test_bf16_gradient_norm_is_exact_and_every_dtype_is_scaled():
    exact, norm, total, before, after, coefficient = run_on_ranks(_clip_bf16, 1, timeout=60)[0]
    # float32 accumulation: a bf16 per-tensor norm would be off by ~1e-3 relative
    assert abs(norm - exact) / exact < 1e-6 and total == norm
    for g0, g1 in zip(before, after):
        assert g1.dtype == g0.dtype
        torch.testing.assert_close(g1, g0 * coefficient.to(g0.dtype), rtol=0, atol=0)
