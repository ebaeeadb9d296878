"""On a GPU: the Triton permute/unpermute kernels give the torch path's rows and slots exactly, its outputs
and gradients (of tokens, rows and probabilities) to rounding, dropless and padded to capacity, and never
synchronize with the host."""

import pytest
import torch

from lightning_megatron.moe import (
    MoEConfig, MoELayer, apply_capacity, expert_capacity, permute_indexed, permute_per_token, permute_probs,
    topk_routing, unpermute, unpermute_per_token,
)
from lightning_megatron.ops import moe_permute as permute_kernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(permute_kernels.triton is None, reason="the kernels need Triton")]

E = 64


def _routing(num_tokens, num_experts, topk, mode, seed=0):
    """(probs, routing_map, num_out) for ``mode``: dropless top-k, padded to capacity, or dropping."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    probs, routing_map = topk_routing(logits, topk)
    if mode == "dropless":
        return probs, routing_map, num_tokens * topk
    factor = 1.0 if mode == "capacity" else 0.7
    capacity = expert_capacity(num_tokens, num_experts, topk, factor)
    probs, routing_map = apply_capacity(probs, routing_map, capacity, "probs", pad_to_capacity=mode == "capacity")
    num_out = num_experts * capacity if mode == "capacity" else int(routing_map.sum())
    return probs, routing_map, num_out


def _forward_backward(kernels, x0, probs0, routing_map, num_out, topk, per_token, out_dtype, g_rows, g_out):
    """permute → rows·2+1 → weighted unpermute, then backward; what the dispatcher does at ep=1."""
    with permute_kernels.kernels_enabled(kernels):
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        num_tokens = x.shape[0]
        if per_token:
            rows, slots, order = permute_per_token(x, routing_map, topk)
            token_rows = None
        else:
            rows, slots, token_rows = permute_indexed(x, routing_map, num_out)
            order = None
        assert (token_rows is not None) == (kernels and not per_token)
        row_probs = permute_probs(probs, slots)
        mid = rows * 2.0 + 1.0
        if per_token:
            out = unpermute_per_token(mid, order, num_tokens, row_probs, out_dtype=out_dtype)
        else:
            out = unpermute(mid, slots, num_tokens, row_probs, out_dtype=out_dtype, token_rows=token_rows)
        ((rows.float() * g_rows).sum() + (out.float() * g_out).sum()).backward()
    return dict(rows=rows.detach(), slots=slots, order=order, out=out.detach(), grad_x=x.grad, grad_probs=probs.grad)


def _close(kernel, reference, dtype, rtol=None):
    """Equal up to the rounding of float32 sums in another order (bfloat16: an ulp of the result's scale)."""
    scale = max(reference.abs().max().item(), 1.0)
    tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(kernel, reference, rtol=rtol or tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("topk", [2, 8])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_kernels_equal_the_torch_path(mode, topk, hidden, dtype):
    num_tokens = 8192
    probs, routing_map, num_out = _routing(num_tokens, E, topk, mode, seed=topk)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(dtype)
    g_rows = torch.randn(num_out, hidden, device="cuda", generator=gen)
    g_out = torch.randn(num_tokens, hidden, device="cuda", generator=gen)
    args = (x, probs, routing_map, num_out, topk, mode == "dropless", dtype, g_rows, g_out)
    ref, ker = _forward_backward(False, *args), _forward_backward(True, *args)
    assert torch.equal(ker["slots"], ref["slots"])
    assert torch.equal(ker["rows"], ref["rows"])
    if mode == "dropless":
        assert torch.equal(ker["order"], ref["order"])
    for name in ("out", "grad_x"):
        _close(ker[name], ref[name], dtype)
    _close(ker["grad_probs"], ref["grad_probs"], torch.float32, rtol=1e-4)


@pytest.mark.parametrize("case", ["drop", "truncated", "sliced-map", "odd-sizes"])
def test_kernels_equal_the_torch_path_on_general_maps(case):
    """Dropping without padding, fewer rows than routed slots, a column slice of the map (the all-gather
    dispatcher's local experts), and sizes that fill no tile."""
    num_tokens, experts, topk, hidden = 4096, E, 4, 512
    if case == "odd-sizes":
        num_tokens, experts, topk, hidden = 1000, 48, 6, 333
    probs, routing_map, num_out = _routing(num_tokens, experts, topk, "drop" if case == "drop" else "dropless")
    if case == "truncated":
        num_out -= 1001
    if case == "sliced-map":
        probs, routing_map = probs[:, 16:32], routing_map[:, 16:32]
        num_out = int(routing_map.sum())
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen)
    g_rows = torch.randn(num_out, hidden, device="cuda", generator=gen)
    g_out = torch.randn(num_tokens, hidden, device="cuda", generator=gen)
    args = (x, probs, routing_map, num_out, topk, False, torch.float32, g_rows, g_out)
    ref, ker = _forward_backward(False, *args), _forward_backward(True, *args)
    assert torch.equal(ker["slots"], ref["slots"]) and torch.equal(ker["rows"], ref["rows"])
    for name in ("out", "grad_x"):
        _close(ker[name], ref[name], torch.float32)
    _close(ker["grad_probs"], ref["grad_probs"], torch.float32, rtol=1e-4)


def test_rows_past_the_routed_ones_are_zero_and_belong_to_no_token():
    probs, routing_map, routed = _routing(512, 16, 2, "dropless")
    x = torch.randn(512, 64, device="cuda", requires_grad=True)
    p = probs.clone().requires_grad_()
    rows, slots, token_rows = permute_indexed(x, routing_map, routed + 37)
    assert token_rows is not None
    assert torch.equal(slots[routed:], torch.zeros_like(slots[routed:]))
    assert torch.equal(rows[routed:], torch.zeros_like(rows[routed:]))
    row_probs = permute_probs(p, slots)
    out = unpermute(rows, slots, 512, row_probs, token_rows=token_rows)
    torch.testing.assert_close(out, x.detach() * probs.sum(1, keepdim=True))
    g = torch.randn(routed + 37, 64, device="cuda")
    (out.sum() + (rows * g).sum()).backward()
    expected = torch.zeros_like(x).index_add(0, slots[:routed] % 512, g[:routed]) + probs.sum(1, keepdim=True)
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(p.grad, x.detach().sum(1, keepdim=True) * routing_map)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_kernels_never_sync(mode):
    topk, hidden = 8, 1024
    probs, routing_map, num_out = _routing(8192, E, topk, mode)
    x = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
    g_rows = torch.randn(num_out, hidden, device="cuda")
    g_out = torch.randn(8192, hidden, device="cuda")
    args = (x, probs, routing_map, num_out, topk, mode == "dropless", torch.bfloat16, g_rows, g_out)
    _forward_backward(True, *args)                                  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_backward(True, *args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("options", [{}, {"capacity_factor": 1.0, "pad_to_capacity": True}],
                         ids=["dropless", "padded"])
def test_moe_layer_with_kernels_equals_the_torch_path(options):
    results = []
    for kernels in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=16, topk=4, **options),
                         device="cuda")
        x = torch.randn(64, 8, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1),
                        requires_grad=True)
        with permute_kernels.kernels_enabled(kernels):
            out = layer(x)
            out.square().mean().backward()
        results.append((out.detach(), x.grad, layer.experts.weight1.grad))
    for ker, ref in zip(results[1], results[0]):
        _close(ker, ref, torch.float32, rtol=1e-4)
