"""Float8 weights cast once per schedule (``quantization/float8_weights.py``, ``Float8Config.cache_weights``): the
same numbers as torchao's float8 linear, bit for bit; the step engine casts every weight once per schedule and the
layers use those casts only inside it; a cast never outlives the weight it was made from."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_megatron.quantization.float8 import Float8Config, enable_fp8
from lightning_megatron.quantization import float8_weights
from lightning_megatron.quantization.float8_weights import (Float8WeightCast, armed_weight_casts, cached_float8_linear,
                                                            float8_weight_casts, install_refresh_hooks)
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _torchao(x, w, g, emulate, pow2):
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = Float8Config("tensorwise", emulate=emulate, round_scales_to_power_of_2=pow2).torchao_config()
    mm_config = Float8Linear(16, 16, bias=False, config=config, device="meta").linear_mm_config
    out = matmul_with_hp_or_float8_args.apply(x, w.t(), mm_config, config)
    out.backward(g)
    return out.detach()


def _same_as_torchao(w, x, g, emulate, pow2, compiled):
    """The cached path's output and gradients against torchao's, bit for bit; returns the cast and torchao's
    gradients (``x.grad`` and ``w.grad`` hold the cached path's)."""
    ref = _torchao(x, w, g, emulate, pow2)
    ref_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    cast = Float8WeightCast(SimpleNamespace(weight=w), pow2, compiled=compiled)
    cast.refresh()
    out = cached_float8_linear(x, w, cast.data, cast.data_t, cast.scale, pow2, emulate)
    out.backward(g)
    assert out.dtype == x.dtype and torch.equal(out, ref)
    assert torch.equal(x.grad, ref_grads[0]) and torch.equal(w.grad, ref_grads[1])
    return cast, ref_grads


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled-mm", "emulated"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2-scales"])
def test_cached_casts_compute_torchaos_float8_linear_bit_for_bit(emulate, pow2):
    """Forward, input gradient and weight gradient equal torchao's ``matmul_with_hp_or_float8_args`` exactly (the
    CPU runs ``torch._scaled_mm`` too), for a weight of another shape than its transpose and a 3-D input."""
    torch.manual_seed(0)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    x = (torch.randn(2, 16, 64, dtype=torch.bfloat16) * 3).requires_grad_()
    g = torch.randn(2, 16, 48, dtype=torch.bfloat16) * 1e-3
    cast, ref_grads = _same_as_torchao(w, x, g, emulate, pow2, compiled=False)
    assert w.grad.dtype == torch.bfloat16

    w.grad = None   # a frozen weight gets no gradient, an input that needs none gets none
    frozen = w.detach()
    out = cached_float8_linear(x, frozen, cast.data, cast.data_t, cast.scale, pow2, emulate)
    out.backward(g)
    assert w.grad is None and frozen.grad is None
    x2 = x.detach()
    cached_float8_linear(x2, w, cast.data, cast.data_t, cast.scale, pow2, emulate).backward(g)
    assert x2.grad is None and torch.equal(w.grad, ref_grads[1])


def test_a_forward_only_cast_leaves_the_transposed_one_as_it_was():
    torch.manual_seed(0)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    cast = Float8WeightCast(SimpleNamespace(weight=w), compiled=False)
    cast.refresh()
    before = cast.data_t.clone()
    w.mul_(3)
    cast.refresh(transposed=False)
    expected, scale = float8_weights._to_float8(w, float8_weights.E4M3, False)
    assert torch.equal(cast.data.float(), expected.float()) and torch.equal(cast.scale, scale)
    assert torch.equal(cast.data_t.float(), before.float())
    cast.refresh()
    assert torch.equal(cast.data_t.float(), expected.float().t())


def test_the_option_and_which_layers_cache(one_rank):
    with pytest.raises(ValueError, match="Float8Config.cache_weights must be True, False or None"):
        Float8Config(cache_weights="yes")
    with pytest.raises(ValueError, match=r"cache_weights=True\) keeps tensorwise .* recipe='rowwise'"):
        Float8Config("rowwise", cache_weights=True)
    assert Float8Config().weights_cached and not Float8Config("rowwise").weights_cached
    assert not Float8Config(cache_weights=False).weights_cached

    col, row = ColumnParallelLinear(32, 64), RowParallelLinear(64, 32, input_is_parallel=True)
    model = nn.Sequential(col, row)
    enable_fp8(model, Float8Config(emulate=True, compile=False))
    casts = float8_weight_casts(model)
    assert [c.linear for c in casts] == [col, row] and not any(c.armed for c in casts)
    other = nn.Sequential(ColumnParallelLinear(32, 64))
    enable_fp8(other, Float8Config("rowwise", emulate=True, compile=False))
    enable_fp8(model2 := nn.Sequential(ColumnParallelLinear(32, 64)), Float8Config(emulate=True, compile=False,
                                                                                 cache_weights=False))
    assert float8_weight_casts(other) == [] and float8_weight_casts(model2) == []

    with torch.no_grad():   # a parameter replaced after enable_fp8 (loading, re-initialisation) is the one cast
        col.weight = nn.Parameter(torch.randn(64, 32) * 7)
    casts[0].refresh()
    expected, scale = float8_weights._to_float8(col.weight.detach(), float8_weights.E4M3, False)
    assert torch.equal(casts[0].data.float(), expected.float()) and torch.equal(casts[0].scale, scale)
    assert torch.equal(casts[0].data_t.float(), expected.float().t())


def _tiny_gpt():
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1,
                               attention_dropout=0.0)
    return GPTModel(config, 128, 32)


def _train(one_rank, cache_weights, calls, steps=3, compile_layers=False):
    """Three SGD steps through the step engine (four micro-batches each, dropout on), the weights also changed
    by hand between steps, then an evaluation batch and, after another weight changed, a direct call; the parameters
    after each step, the evaluation's and the direct call's outputs."""
    from lightning_megatron.distributed.config import GradientConfig
    from lightning_megatron.distributed.gradients import GradientState
    from lightning_megatron.engine import StepEngine
    from lightning_megatron.tensor_parallel import model_parallel_seed

    model_parallel_seed(1234)
    model = _tiny_gpt()
    enable_fp8(model, Float8Config(emulate=True, compile=compile_layers, compile_layers=compile_layers,
                                   cache_weights=cache_weights))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = StepEngine(model, one_rank, device=torch.device("cpu"), micro_batch_size=2)
    grads = GradientState(list(model.parameters()), one_rank, GradientConfig(), optimizers=[opt], modules=[model])
    gen = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, 128, (8, 32), generator=gen), "labels": torch.randint(0, 128, (8, 32), generator=gen)}

    def last_stage(mb):
        loss = model(mb["ids"], labels=mb["labels"]).float().mean()
        return loss, loss.detach()

    after = []
    for step in range(steps):
        grads.zero()
        grads.before_schedule()
        engine.run(batch, last_stage, no_sync=grads.schedule_no_sync)
        grads.finalize([model])
        grads.expose()
        opt.step()
        grads.after_optimizer_step()
        if step == 0:   # as a callback might (weight averaging): the next schedule must cast these weights
            with torch.no_grad():
                model.decoder.layers[0].mlp.fc1.weight.mul_(0.5)
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    calls["schedule"] = dict(calls)
    with torch.no_grad():
        evaluated = engine.run(batch, lambda mb: model(mb["ids"]), forward_only=True).outputs
        model.decoder.layers[1].mlp.fc2.weight.mul_(2.0)
        direct = model(batch["ids"][:2])   # outside any schedule: torchao's casts of the weights as they are now
    engine.close()
    return after, torch.cat(evaluated), direct


def test_the_engine_casts_once_per_schedule_and_trains_as_recasting_does(one_rank, monkeypatch):
    """With the weights cast once per schedule, training equals recasting in every call bit for bit (dropout on, a
    weight changed by hand between steps, four micro-batches a step), evaluation and a direct call too; each weight
    is cast once per schedule and every linear's micro-batches use the cast."""
    calls = {"refresh": 0, "transposed": 0, "cached": 0}
    refresh, apply = Float8WeightCast.refresh, float8_weights._CachedWeightFloat8Linear.apply

    def counted_refresh(self, transposed=True):
        calls["refresh"] += 1
        calls["transposed"] += transposed
        return refresh(self, transposed)

    def counted_apply(*args):
        calls["cached"] += 1
        return apply(*args)

    monkeypatch.setattr(Float8WeightCast, "refresh", counted_refresh)
    monkeypatch.setattr(float8_weights._CachedWeightFloat8Linear, "apply", counted_apply)
    cached = _train(one_rank, None, calls)
    recast_calls = {"refresh": 0, "cached": 0}
    monkeypatch.setattr(Float8WeightCast, "refresh", refresh)
    recast = _train(one_rank, False, recast_calls)
    for step, (a, b) in enumerate(zip(cached[0], recast[0])):
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)
    assert torch.equal(cached[1], recast[1]) and torch.equal(cached[2], recast[2])
    assert not torch.equal(cached[0][0]["decoder.layers.0.mlp.fc1.weight"],
                           cached[0][1]["decoder.layers.0.mlp.fc1.weight"])
    linears = 2 * 4   # per layer: the fused qkv projection, the attention's output, fc1, fc2
    # three training schedules and (in `calls` only after) one evaluation schedule, which casts in the forward
    # GEMM's layout only (no backward reads the transposed cast)
    assert calls["schedule"] == {"refresh": 3 * linears, "transposed": 3 * linears, "cached": 3 * 4 * linears}, calls
    assert calls["refresh"] == 4 * linears and calls["cached"] == (3 * 4 + 4) * linears, calls
    assert calls["transposed"] == 3 * linears, calls


def test_compiled_layers_trace_the_cached_casts_and_train_as_recasting_does(one_rank):
    """Inside compiled layers (``compile_layers``, the casts traced into each layer's graph): no graph break, one
    graph for training and one for evaluation, the graphs reading the casts, and the same training as recasting
    in every call."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    runs = []
    for cache_weights in (None, False):
        torch._dynamo.reset()
        counters.clear()
        runs.append(_train(one_rank, cache_weights, {}, compile_layers=True))
        assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # the compiled graphs read the casts (a count of calls would not tell: dynamo traces the function once, its
    # own way): casts overwritten with zeros but marked ready change what the compiled layers compute
    model = _tiny_gpt().eval()   # no dropout: the two calls differ only by the casts
    enable_fp8(model, Float8Config(emulate=True, compile_layers=True))
    casts, hooks = float8_weight_casts(model), install_refresh_hooks(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with armed_weight_casts(casts):
            honest = model(ids)
        for cast in casts:
            cast.data.zero_()
            cast.armed, cast.stale = True, False
        assert not torch.equal(model(ids), honest)
    for hook in hooks:
        hook.remove()
    (cached, cached_eval, cached_direct), (recast, recast_eval, recast_direct) = runs
    for step, (a, b) in enumerate(zip(cached, recast)):
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{step} {name}: {m}")
    torch.testing.assert_close(cached_eval, recast_eval, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cached_direct, recast_direct, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_gpu_cached_casts_equal_torchao_and_train_compiled_like_recasting(one_rank):
    """On the GPU: the cached path's GEMMs are torchao's (bit for bit, eager), and compiled bf16 layers trained
    through the engine with the casts made once per schedule follow recasting within bf16 noise."""
    torch.manual_seed(0)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    _same_as_torchao(w, x, g, False, False, compiled=True)

    from lightning_megatron.distributed.config import GradientConfig
    from lightning_megatron.distributed.gradients import GradientState
    from lightning_megatron.engine import StepEngine
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig
    from torch import _dynamo

    def train(cache_weights):
        _dynamo.reset()
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0)
        model = GPTModel(config, 512, 64).to("cuda", torch.bfloat16)
        enable_fp8(model, Float8Config(compile_layers=True, cache_weights=cache_weights))
        assert bool(float8_weight_casts(model)) == (cache_weights is None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = StepEngine(model, one_rank, device=torch.device("cuda"), micro_batch_size=2)
        grads = GradientState(list(model.parameters()), one_rank, GradientConfig(), optimizers=[opt],
                              modules=[model])
        gen = torch.Generator().manual_seed(0)
        batch = {"ids": torch.randint(0, 512, (8, 64), generator=gen).cuda(),
                 "labels": torch.randint(0, 512, (8, 64), generator=gen).cuda()}
        losses = []
        for _ in range(6):
            grads.zero()
            grads.before_schedule()
            result = engine.run(batch, lambda mb: (lambda l: (l, l.detach()))(
                model(mb["ids"], labels=mb["labels"]).float().mean()), no_sync=grads.schedule_no_sync)
            grads.finalize([model])
            grads.expose()
            opt.step()
            grads.after_optimizer_step()
            losses.append(float(result.loss))
        return losses

    cached, recast = train(None), train(False)
    assert cached == pytest.approx(recast, rel=2e-3)
    assert cached[-1] < cached[0] - 0.05
