"""The output layer in float8 (``Float8Config(output_layer=True)``, ``quantization/float8_output.py``): the fused
loss's three GEMMs against a reference written here from the definition (quantize each operand with its scale,
dequantize, multiply in float32), at one rank and per shard at tp2; the option's errors; through ``GPTModel``.
``torch._scaled_mm`` runs on the CPU, so these are the real float8 GEMMs, not an emulation."""

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.quantization.float8 import Float8Config, enable_fp8
from lightning_megatron.quantization.float8_output import Float8OutputLayer
from lightning_megatron.tensor_parallel.fused_cross_entropy import linear_cross_entropy

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EMULATED = dict(compile=False, emulate=True)


def dequantized(x, dtype, scale=None):
    """``x`` rounded through ``dtype`` with the tensorwise scale ``finfo.max / amax`` (or ``scale``), in float32."""
    x = x.float()
    if scale is None:
        scale = torch.finfo(dtype).max / x.abs().max().clamp(min=1e-12)
    return (x * scale).to(dtype).float() / scale


def reference(hidden, weight, target, g, vocab_start=0, group=None, bias=None):
    """Loss, grad_hidden (this rank's partial) and grad_weight of the float8 output layer from the definition:
    e4m3 hidden and weight (dynamic scales) for the logits; the weight gradient from e5m2 ``D`` at the fixed scale
    2^15 and e4m3 ``g ⊙ hidden``; grad_hidden in high precision from ``D`` unrounded and the weight as it is."""
    h, w = dequantized(hidden, E4M3), dequantized(weight, E4M3)
    logits = h @ w.t() + (0 if bias is None else bias)
    if group is not None:   # the whole vocabulary's logits, shard by shard
        parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, logits, group=group)
        full = torch.cat(parts, dim=1)
    else:
        full = logits
    loss = F.cross_entropy(full, target, reduction="none")
    d = torch.softmax(full, dim=1) - F.one_hot(target, full.shape[1]).float()
    d = d[:, vocab_start:vocab_start + weight.shape[0]]
    grad_hidden = (d @ weight.float()) * g[:, None]
    grad_weight = dequantized(d, E5M2, scale=2.0 ** 15).t() @ dequantized(hidden.float() * g[:, None], E4M3)
    if bias is not None:
        return loss, grad_hidden, grad_weight, d.t() @ g
    return loss, grad_hidden, grad_weight


def _inputs(tokens=32, hidden=64, vocab=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen) * 0.2,
            torch.randint(0, vocab, (tokens,), generator=gen), torch.rand(tokens, generator=gen))


def _run(hidden, weight, target, g, **kwargs):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=None, **kwargs)
    loss.backward(g)
    return loss.detach(), hidden.grad, weight.grad


def test_the_three_gemms_equal_the_definition(one_rank):
    hidden, weight, target, g = _inputs()
    fp8 = Float8OutputLayer("output_layer", unfused=F.linear, compile=False)
    loss, grad_hidden, grad_weight = _run(hidden, weight, target, g, low_precision=fp8)
    ref_loss, ref_hidden, ref_weight = reference(hidden, weight, target, g)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_hidden, ref_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight, ref_weight, rtol=1e-5, atol=1e-6)
    # and float8, not high precision: the float32 path differs by float8's rounding, not more
    hp_loss, hp_hidden, hp_weight = _run(hidden, weight, target, g)
    assert 0 < (loss - hp_loss).abs().max() < 0.05 * hp_loss.abs().max()
    assert not torch.equal(grad_weight, hp_weight)
    assert F.cosine_similarity(grad_weight.flatten(), hp_weight.flatten(), dim=0) > 0.98
    assert F.cosine_similarity(grad_hidden.flatten(), hp_hidden.flatten(), dim=0) > 0.98


def test_emulation_multiplies_the_same_float8_values_in_float32(one_rank):
    hidden, weight, target, g = _inputs()
    real = _run(hidden, weight, target, g, low_precision=Float8OutputLayer("o", F.linear, compile=False))
    emulated = _run(hidden, weight, target, g, low_precision=Float8OutputLayer("o", F.linear, compile=False,
                                                                                emulate=True))
    for a, b in zip(real, emulated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_output_bias(one_rank):
    hidden, weight, target, g = _inputs()
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(5)).requires_grad_()
    fp8 = Float8OutputLayer("output_layer", unfused=F.linear, compile=False)
    loss, grad_hidden, grad_weight = _run(hidden, weight, target, g, low_precision=fp8, bias=bias)
    ref = reference(hidden, weight, target, g, bias=bias.detach())
    for ours, theirs in zip((loss, grad_hidden, grad_weight, bias.grad), ref):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_ignored_tokens_padding_rows_and_bf16(one_rank):
    hidden, weight, target, g = _inputs(tokens=48, vocab=144)
    target = target % 128
    target[::5] = -100
    fp8 = Float8OutputLayer("output_layer", unfused=F.linear, compile=False)
    # 144 padded rows, 128 real: the last 16 take no mass and get no gradient
    loss, grad_hidden, grad_weight = _run(hidden, weight, target, g, low_precision=fp8, vocab_size=128)
    kept = target != -100
    ref_loss, ref_hidden, ref_weight = reference(hidden[kept], weight[:128], target[kept], g[kept])
    torch.testing.assert_close(loss[kept], ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.all(loss[~kept] == 0) and torch.all(grad_hidden[~kept] == 0)
    torch.testing.assert_close(grad_hidden[kept], ref_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight[:128], ref_weight, rtol=1e-5, atol=1e-6)
    assert torch.all(grad_weight[128:] == 0)
    bf16 = _run(hidden.bfloat16(), weight.bfloat16(), target, g, low_precision=fp8, vocab_size=128)
    assert all(t.dtype == torch.bfloat16 for t in bf16[1:])
    torch.testing.assert_close(bf16[0][kept], ref_loss, rtol=2e-2, atol=2e-2)


def test_shapes_that_float8_cannot_multiply_are_refused_by_name(one_rank):
    hidden, weight, target, g = _inputs(tokens=24)
    fp8 = Float8OutputLayer("model.output_layer", unfused=F.linear, compile=False)
    with pytest.raises(ValueError, match=r"^model.output_layer: Float8Config\(output_layer=True\) .* \[24 tokens x 64\]"
                                         r".* multiple of 16"):
        _run(hidden, weight, target, g, low_precision=fp8)
    with pytest.raises(ValueError, match=r"chunk_size=4096 asks for chunks: set the model's cross_entropy_chunk_size"):
        linear_cross_entropy(hidden, weight, target, chunk_size=4096, low_precision=fp8)


def _tp2(sequence_parallel):
    from helpers.tp_utils import tp_state

    state = tp_state()
    r, group = state.tp_rank, state.tp_group
    hidden, weight, target, g = _inputs(tokens=32, vocab=256, seed=3)
    shard = weight.chunk(2)[r]
    fp8 = Float8OutputLayer("output_layer", unfused=F.linear, compile=False)
    loss, grad_hidden, grad_weight = _run(hidden, shard, target, g, low_precision=fp8, group=group)
    ref_loss, ref_hidden, ref_weight = reference(hidden, shard, target, g, vocab_start=128 * r, group=group)
    close = dict(rtol=1e-5, atol=1e-6)
    return {"loss": torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5),
            "grad_hidden (this rank's partial)": torch.allclose(grad_hidden, ref_hidden, **close),
            "grad_weight (this rank's rows)": torch.allclose(grad_weight, ref_weight, **close)}


def test_tensor_parallel_shards_scale_their_own_rows():
    from lightning_megatron.testing import run_on_ranks

    for checks in run_on_ranks(_tp2, 2, False, timeout=120):
        assert len(checks) == 3 and all(checks.values()), {k: v for k, v in checks.items() if not v}


def tiny_gpt(**kwargs):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    return GPTModel(config, 128, 32, **kwargs)


def test_gpt_model_output_layer_in_float8(one_rank, monkeypatch):
    ref, model = tiny_gpt(fused_cross_entropy=True), tiny_gpt(fused_cross_entropy=True)
    names = enable_fp8(model, Float8Config(output_layer=True, **EMULATED))
    assert "output_layer" in names and len(names) == 9
    assert repr(model.output_float8) == "tensorwise output layer (emulated)" and model.output_float8.emulate
    assert enable_fp8(tiny_gpt(), Float8Config(**EMULATED)) == names[:-1]     # off by default
    calls = []
    forward = Float8OutputLayer.forward
    monkeypatch.setattr(Float8OutputLayer, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 128, (2, 32), generator=gen), torch.randint(0, 128, (2, 32), generator=gen)
    ref_loss, loss = (m(ids, labels=labels).mean() for m in (ref, model))
    torch.autograd.backward([ref_loss, loss])
    assert calls == [1]
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2) and loss.item() != ref_loss.item()
    w_ref, w_fp8 = ref.embedding.word_embeddings.weight.grad, model.embedding.word_embeddings.weight.grad
    assert F.cosine_similarity(w_ref.flatten(), w_fp8.flatten(), dim=0) > 0.98
    assert w_fp8.norm() == pytest.approx(w_ref.norm().item(), rel=0.05)   # the scale too (a cosine hides it)
    # without labels the logits come from the float8 projection too (torchao's float8 linear)
    unfused = []
    monkeypatch.setattr(model.output_float8, "unfused", lambda *a: unfused.append(1) or F.linear(*a))
    with torch.no_grad():
        assert model(ids).shape == (2, 32, 128) and unfused == [1]


def test_output_layer_option_errors(one_rank):
    from torch import nn

    with pytest.raises(ValueError, match=r"output_layer=True\) runs the output layer with tensorwise scales only, "
                                         r"got recipe='rowwise'"):
        Float8Config("rowwise", output_layer=True)
    with pytest.raises(ValueError, match="Float8Config.output_layer must be True or False"):
        Float8Config(output_layer="yes")
    with pytest.raises(ValueError, match=r"cross_entropy_chunk_size=16 asks for chunks: set "
                                         r"cross_entropy_chunk_size=None, or output_layer=False"):
        enable_fp8(tiny_gpt(cross_entropy_chunk_size=16), Float8Config(output_layer=True, **EMULATED))
    with pytest.raises(ValueError, match=r"Sequential holds no GPTModel: set output_layer=False"):
        enable_fp8(nn.Sequential(nn.Linear(16, 16)), Float8Config(output_layer=True, **EMULATED))

    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    odd = GPTModel(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), 100, 32)
    with pytest.raises(ValueError, match=r"output_layer multiplies 64 hidden features by \[100\] vocabulary rows .*"
                                         r"pad the vocabulary to a multiple of 16"):
        enable_fp8(odd, Float8Config(output_layer=True, **EMULATED))


# -- on a GPU: cuBLAS's float8 GEMMs, the compiled casts, the fused loss's Triton passes -----------------------


def _relative(ours, ref):
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-casts", "compiled-casts"])
def test_gpu_each_gemm_equals_its_definition(one_rank, compiled):
    """Each GEMM from given operands (not the whole loss: logits a little off move entries of ``D`` across e5m2
    rounding steps of 1/8, which the CPU test above avoids by computing exactly as the definition does)."""
    hidden, weight, _, g = (t.cuda() for t in _inputs(tokens=256, hidden=256, vocab=1024, seed=1))
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    d = torch.softmax(torch.randn(256, 1024, device="cuda"), dim=1) - F.one_hot(
        torch.randint(0, 1024, (256,), device="cuda"), 1024).float()
    fp8 = Float8OutputLayer("output_layer", unfused=F.linear, compile=compiled)
    logits, weight_q = fp8.forward(hidden, weight)
    grad_q = fp8.quantize_grad(d.bfloat16())
    h, w = dequantized(hidden, E4M3), dequantized(weight, E4M3)
    d8 = dequantized(d.bfloat16(), E5M2, scale=2.0 ** 15)
    assert logits.dtype == torch.bfloat16 and _relative(logits, h @ w.t()) < 5e-3     # fast accumulation, bf16 out
    # Hopper's float8 tensor cores accumulate with fewer bits than float32 even without fast accumulation:
    # 3.8e-4 measured on an H200 (torch 2.11), against 1e-5 on the CPU
    scaled = dequantized(hidden.float() * g[:, None], E4M3)
    assert _relative(fp8.grad_weight(grad_q, hidden.float(), g[:, None]), d8.t() @ scaled) < 2e-3
    # grad_hidden in bf16 from D unrounded (not float8: see float8_output's docstring)
    assert _relative(fp8.grad_hidden(grad_q, weight_q, torch.float32), d.bfloat16().float() @ weight.float()) < 1e-2
    assert _relative(fp8.grad_hidden(grad_q, weight_q, torch.float32), d8 @ w) > 2e-2
    # the transposed D the cast wrote holds D's values (to e5m2's rounding)
    assert torch.equal(grad_q[1].float().t() * grad_q[2], d8)


@pytest.mark.gpu
def test_gpu_tiny_gpt_with_the_output_layer_in_float8_is_close_to_bfloat16(one_rank):
    from lightning_megatron.tensor_parallel.fused_cross_entropy import fused_kernels_run

    def gpt():
        from lightning_megatron.models import GPTModel
        from lightning_megatron.transformer import TransformerConfig

        torch.manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0)
        return GPTModel(config, 1024, 64).to("cuda", torch.bfloat16)

    ref, linears, model = gpt(), gpt(), gpt()
    enable_fp8(linears, Float8Config("tensorwise"))
    enable_fp8(model, Float8Config("tensorwise", output_layer=True))
    assert model.output_float8 is not None and linears.output_float8 is None
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 1024, (4, 64), generator=gen).cuda() for _ in range(2))
    assert fused_kernels_run(ids.float())
    results = []
    for m in (ref, linears, model):
        loss = m(ids, labels=labels).float().mean()
        loss.backward()
        results.append((loss.item(), m.embedding.word_embeddings.weight.grad.float().flatten()))
    (ref_loss, ref_grad), (lin_loss, _), (loss, grad) = results
    assert loss == pytest.approx(ref_loss, rel=2e-2) and loss != lin_loss
    assert F.cosine_similarity(ref_grad, grad, dim=0) > 0.98
    assert grad.norm().item() == pytest.approx(ref_grad.norm().item(), rel=0.05)   # the scale (a cosine hides it)
