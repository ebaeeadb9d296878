"""Float8 grouped MoE experts (``Float8Config(grouped_experts=True)``, off by default): which experts convert
(CPU), and on a Hopper GPU: closeness to the bfloat16 grouped GEMM in outputs and every gradient, no host sync,
CUDA-graph capture, and an MoE GPT trained in float8 next to bfloat16."""

import pytest
import torch

from lightning_megatron.quantization.float8 import Float8Config, Float8GroupedMatmul, enable_fp8
from lightning_megatron.moe import GroupedMLP, MoEConfig

needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                  reason="float8 grouped GEMMs need a CUDA GPU of compute capability >= 9.0")


def moe_gpt(hidden=64, ffn=64, experts=4, vocab=128, seq=32, device=None):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    torch.manual_seed(0)
    moe = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, topk=2, aux_loss_coeff=1e-2)
    config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, moe=moe)
    return GPTModel(config, vocab, seq)


def _experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, GroupedMLP)}


def test_experts_stay_in_high_precision_by_default_and_under_emulation_with_a_warning(one_rank):
    model = moe_gpt()
    assert len(_experts(model)) == 2
    with pytest.warns(UserWarning, match=r"experts stay in high precision \(Float8Config\(grouped_experts=True\) "
                                         r"runs them in float8.*decoder\.layers\.0\.mlp\.experts"):
        names = enable_fp8(model, Float8Config(compile=False, emulate=True))
    assert not any(n in names for n in _experts(model)) and all(m.float8 is None for m in _experts(model).values())
    assert len(names) == 2 * 2   # the attention's qkv and proj of each layer (the MLPs are MoE)
    model = moe_gpt()
    with pytest.warns(UserWarning, match=r"experts stay in high precision with emulate=True"):
        enable_fp8(model, Float8Config(compile=False, emulate=True, grouped_experts=True))
    assert all(m.float8 is None for m in _experts(model).values())


def test_grouped_experts_option_is_validated():
    with pytest.raises(ValueError, match="grouped_experts must be True or False"):
        Float8Config(grouped_experts="yes")


def test_float8_grouped_matmul_refuses_cpu_inputs_by_name():
    fn = Float8GroupedMatmul("decoder.layers.0.mlp.experts")
    with pytest.raises(RuntimeError, match=r"decoder\.layers\.0\.mlp\.experts: .*CUDA GPU.*grouped_experts=False"):
        fn(torch.zeros(16, 16), torch.zeros(2, 16, 16), torch.tensor([8, 16], dtype=torch.int32))


# -- on a Hopper GPU ---------------------------------------------------------------------------------------------

def _bf16_experts(experts=8, hidden=256, ffn=512, activation="swiglu"):
    torch.manual_seed(0)
    mlp = GroupedMLP(experts, hidden, ffn, activation=activation, params_dtype=torch.bfloat16, device="cuda",
                     perform_initialization=False)
    with torch.no_grad():
        for w in mlp.parameters():
            w.normal_(0.0, 0.05)
    return mlp


def _run(mlp, x, counts, grad):
    x = x.detach().clone().requires_grad_()
    out = mlp(x, counts)
    out.backward(grad)
    grads = [x.grad, mlp.weight1.grad, mlp.weight2.grad]
    mlp.zero_grad(set_to_none=True)
    return [out.detach()] + grads


def _relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gpu_float8_experts_are_close_to_bfloat16_without_host_syncs(one_rank, activation):
    mlp = _bf16_experts(activation=activation)
    counts = torch.tensor([5, 0, 170, 33, 1, 64, 0, 47], device="cuda")   # uneven, empty, unaligned groups
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(x.shape[0], 256, device="cuda", dtype=torch.bfloat16)
    mlp.backend = "grouped_mm"
    reference = _run(mlp, x, counts, grad)
    enable_fp8(mlp, Float8Config("rowwise", compile=False, grouped_experts=True))
    assert isinstance(mlp.float8, Float8GroupedMatmul)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")   # a host sync anywhere in forward or backward raises
    try:
        got = _run(mlp, x, counts, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(("output", "input grad", "weight1 grad", "weight2 grad"), got, reference):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        assert _relative_error(a, b) < 0.08, (name, _relative_error(a, b))   # float8 e4m3: ~2-5% here
        assert _relative_error(a, b) > 1e-3, name   # and float8 really ran (a bf16 fallback would match)
    # the empty experts get exactly zero weight gradients (no padding row leaks into them)
    assert not got[2][1].any() and not got[2][6].any() and not got[3][1].any()


@pytest.mark.gpu
@needs_hopper
def test_gpu_float8_experts_capture_in_a_cuda_graph(one_rank):
    mlp = _bf16_experts()
    enable_fp8(mlp, Float8Config("rowwise", compile=False, grouped_experts=True))
    rows = 256
    static_x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_counts = torch.tensor([32] * 8, device="cuda")
    static_g = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        out = mlp(static_x, static_counts)
        out.backward(static_g)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):   # Triton kernels compile here
            step()
    torch.cuda.current_stream().wait_stream(side)
    mlp.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    # replay with other counts (the routing changes every step) and other rows
    counts = torch.tensor([3, 100, 0, 61, 17, 40, 35, 0], device="cuda")
    x, g = torch.randn_like(static_x), torch.randn_like(static_g)
    with torch.no_grad():
        static_x.copy_(x)
        static_g.copy_(g)
        static_counts.copy_(counts)
        for p in list(mlp.parameters()) + [static_x]:
            p.grad.zero_()
    graph.replay()
    replayed = [static_out.clone(), static_x.grad.clone(), mlp.weight1.grad.clone(), mlp.weight2.grad.clone()]
    mlp.zero_grad(set_to_none=True)
    eager = _run(mlp, x, counts, g)
    for a, b in zip(replayed, eager):   # the same kernels on the same numbers
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.gpu
@needs_hopper
def test_gpu_moe_gpt_trains_in_float8_like_bfloat16(one_rank):
    """A few AdamW steps of an MoE GPT (experts and linears in float8) track bfloat16's losses."""
    losses = {}
    for name in ("bf16", "fp8"):
        model = moe_gpt(hidden=128, ffn=256, experts=8, vocab=256, seq=64).cuda().to(torch.bfloat16)
        if name == "fp8":
            converted = enable_fp8(model, Float8Config("rowwise", compile=False, grouped_experts=True))
            assert set(_experts(model)) <= set(converted)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        losses[name] = []
        for _ in range(12):
            start = torch.randint(0, 256, (8, 1), generator=gen)
            ids = ((start + torch.arange(65)) % 256).cuda()   # learnable: counting sequences
            loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["fp8"][-1] < 0.8 * losses["fp8"][0]          # it learns
    assert losses["fp8"] != losses["bf16"]                     # in float8: not bf16's numbers
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert a == pytest.approx(b, rel=0.05), (losses["fp8"], losses["bf16"])
