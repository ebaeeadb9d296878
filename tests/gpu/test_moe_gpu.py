"""On a GPU: the single-rank MoE layer (dropless and padded) runs forward+backward in bfloat16 without
one device→host synchronization, and the grouped GEMM agrees with the per-expert loop."""

import pytest
import torch

from lightning_megatron.moe import MoEConfig, MoELayer, grouped_mm_available

H, FFN, E, K = 256, 512, 8, 2


def _layer(backend, **options):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, topk=K, aux_loss_coeff=1e-2,
                    z_loss_coeff=1e-3, expert_backend=backend, **options)
    return MoELayer(cfg, params_dtype=torch.bfloat16, device="cuda")


def _step(layer, x):
    out = layer(x)
    out.float().square().mean().backward()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"capacity_factor": 1.0, "pad_to_capacity": True}],
                         ids=["dropless", "padded"])
def test_ep1_moe_forward_backward_never_syncs(options):
    layer = _layer("auto", **options)
    x = torch.randn(128, 4, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _step(layer, x)                                   # warm-up: lazy init, the grouped-GEMM probe
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _step(layer, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.experts.weight1.grad).all()
    if not options:
        expected = "grouped_mm" if grouped_mm_available(x.device, x.dtype) else "loop"
        assert layer.experts.pick_backend(x, None) == expected
        assert expected == "grouped_mm" or torch.cuda.get_device_capability() < (9, 0), \
            "torch._grouped_mm should run on a Hopper GPU"


@pytest.mark.gpu
def test_grouped_gemm_matches_the_per_expert_loop():
    grouped, loop = _layer("auto"), _layer("loop")
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(128, 4, H, device="cuda", dtype=torch.bfloat16)
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_g, out_l = _step(grouped, xg), _step(loop, xl)
    torch.testing.assert_close(out_g, out_l, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(xg.grad, xl.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grouped.experts.weight1.grad, loop.experts.weight1.grad, atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(grouped.experts.weight2.grad, loop.experts.weight2.grad, atol=2e-2, rtol=5e-2)
