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


def _norms_with_experts():
    """One process, some parameters experts (their own reduction group, alone here): every one counts."""
    state = ParallelState(ParallelLayout(1)).activate()
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (64, 9, 33, 5)]
    for p in params[2:]:
        p.expert_parallel = True
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    norms = {inf: float(global_grad_norm(params, state, norm_type=inf)) for inf in (2.0, float("inf"))}
    state.destroy()
    return float(exact), float(max(p.grad.abs().max() for p in params)), norms


def test_expert_gradients_count_when_their_group_is_alone():
    exact, largest, norms = run_on_ranks(_norms_with_experts, 1, timeout=60)[0]
    assert abs(norms[2.0] - exact) / exact < 1e-6
    assert norms[float("inf")] == largest
