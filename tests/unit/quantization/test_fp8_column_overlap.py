"""Float8 column-parallel linears overlap their input gradient's collective with the weight gradient's GEMM
(``tensor_parallel/column_backward.py`` with the float8 matmul's GEMMs one at a time, ``Float8Matmul.split_gemms``)
when the weight is cast for a step run in CUDA graphs: the same numbers as gathering and then calling the float8
linear whole, bit for bit, and the collective started before the weight gradient's GEMM."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.quantization.float8 import Float8Config, Float8Matmul, enable_fp8
from lightning_megatron.quantization.float8_weights import float8_weight_casts
from lightning_megatron.tensor_parallel import ColumnParallelLinear, mappings
from lightning_megatron.testing import run_on_ranks
from helpers.tp_utils import tp_state

TOKENS, IN, OUT = 32, 32, 64


def _column(sequence_parallel, bias, split, ready=True, autocast=False, graphed=True):
    """One float8 column-parallel linear's output and gradients (input, weight, bias) at tp = world, its weight cast
    for the step (``ready``) of a schedule in CUDA graphs (``graphed``); ``split=False`` turns the split GEMMs off (the layer gathers, then calls the float8
    matmul whole); the order in which the backward started the collective and the weight gradient's GEMM."""
    state = tp_state()
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, bias=bias, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.weight.mul_(torch.linspace(0.5, 3, layer.weight.shape[0])[:, None])
        if bias:
            layer.bias.copy_(torch.linspace(-1, 1, layer.bias.shape[0]))
    enable_fp8(layer, Float8Config(emulate=True, compile=False))
    (cast,) = float8_weight_casts(layer)
    cast.refresh()
    cast.armed, cast.stale, cast.graphed = ready, not ready, graphed
    rows = TOKENS // state.tp_size if sequence_parallel else TOKENS
    x = (torch.randn(TOKENS, 2, IN, generator=torch.Generator().manual_seed(1)) * 4)
    x = x.chunk(state.tp_size, 0)[state.tp_rank] if sequence_parallel else x
    x = x[:rows].contiguous().requires_grad_()
    g = torch.randn(TOKENS, 2, layer.weight.shape[0], generator=torch.Generator().manual_seed(2 + state.tp_rank))

    order = []
    weight_grad_gemm, split_gemms = Float8Matmul.weight_grad_gemm, Float8Matmul.split_gemms
    # every entry point of the collective (column_backward.py calls dist's, mappings.py its own reference)
    targets = [(mappings, "_reduce_scatter_single"), (dist, "reduce_scatter_tensor")] if sequence_parallel else [
        (dist, "all_reduce")]
    originals = [getattr(obj, attr) for obj, attr in targets]

    def recorded(original):
        def collective(*args, **kwargs):
            order.append("collective")
            return original(*args, **kwargs)
        return collective

    def weight_gemm(self, *args):
        order.append("weight gradient")
        return weight_grad_gemm(self, *args)

    for (obj, attr), original in zip(targets, originals):
        setattr(obj, attr, recorded(original))
    Float8Matmul.weight_grad_gemm = weight_gemm
    if not split:
        Float8Matmul.split_gemms = lambda self, *args: None
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):   # float32 weights, bf16 GEMM inputs
            out = layer(x)
        out.backward(g.to(out.dtype))
    finally:
        for (obj, attr), original in zip(targets, originals):
            setattr(obj, attr, original)
        Float8Matmul.weight_grad_gemm = weight_grad_gemm
        Float8Matmul.split_gemms = split_gemms
    return (out.detach(), x.grad, layer.weight.grad, layer.bias.grad if bias else None), order


def _compare(sequence_parallel, bias, autocast):
    split, split_order = _column(sequence_parallel, bias, split=True, autocast=autocast)
    whole, whole_order = _column(sequence_parallel, bias, split=False, autocast=autocast)
    recast, recast_order = _column(sequence_parallel, bias, split=True, ready=False, autocast=autocast)   # stale
    again, again_order = _column(sequence_parallel, bias, split=True, autocast=autocast)   # (nothing left patched)
    eager, eager_order = _column(sequence_parallel, bias, split=True, autocast=autocast, graphed=False)
    assert split[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert split[2].dtype == torch.float32   # the parameter's gradient in its own dtype
    assert again_order == split_order and all(torch.equal(a, b) for a, b in zip(again, split) if a is not None)
    same = [torch.equal(a, b) if a is not None else b is None for a, b in zip(split, whole)]
    if autocast:
        # the output: torchao's exactly (the whole cached path's emulated GEMM ran under autocast, in bf16; a CPU
        # emulation matter: torch._scaled_mm is not autocast); the input gradient: reduce-scattered in bf16 where
        # the whole path did it in float32 (split layers gather in the autocast dtype, as bf16 layers do)
        same[0] = torch.equal(split[0], recast[0])
        same[1] = torch.allclose(split[1], whole[1], rtol=2e-2, atol=1e-2 * whole[1].abs().max().item())
    same_recast = [torch.equal(a, b) if a is not None else b is None for a, b in zip(recast, whole)]
    same_recast[0] = same[0] if autocast else same_recast[0]
    same_eager = [torch.equal(a, b) if a is not None else b is None for a, b in zip(eager, whole)]
    return same, same_recast + same_eager, split_order, whole_order, recast_order + eager_order


@pytest.mark.parametrize("sequence_parallel, bias, autocast", [(True, False, False), (False, True, False),
                                                             (True, True, True)],
                         ids=["sp", "replicated-bias", "sp-bias-autocast"])
def test_float8_column_parallel_backward_overlaps_and_equals_the_whole_matmul(sequence_parallel, bias, autocast):
    results = run_on_ranks(_compare, 2, sequence_parallel, bias, autocast, timeout=120)
    for same, same_recast, split_order, whole_order, recast_order in results:
        assert same == [True] * 4, same
        assert same_recast == [True] * 8, same_recast   # a stale cast, and an eager schedule: the whole path
        # split: the collective starts before the weight gradient's GEMM; whole: the matmul's own backward, no split
        assert split_order == ["collective", "weight gradient"], split_order
        assert whole_order == ["collective"] and recast_order == ["collective"] * 2, (whole_order, recast_order)


def _compiled_vs_eager():
    """A tiny float8 GPT at tp2 + SP (dropout on), its weights cast for the step: compiled layers against eager
    ones; the split GEMMs' forward counted (they run eagerly, inside the column-parallel linear's graph break)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightning_megatron.models import GPTModel
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.transformer.compile import compile_layers

    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=2)).activate()
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 128, (2, 32), generator=gen), torch.randint(0, 128, (2, 32), generator=gen)
    forward_gemm, out = Float8Matmul.forward_gemm, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1,
                                   attention_dropout=0.0, sequence_parallel=True)
        model = GPTModel(config, 128, 32)
        enable_fp8(model, Float8Config(emulate=True, compile=False))
        for cast in float8_weight_casts(model):
            cast.refresh()
            cast.armed, cast.stale, cast.graphed = True, False, True
        if compiled:
            compile_layers(model)
        calls = [0]

        def counted(self, *args):
            calls[0] += 1
            return forward_gemm(self, *args)

        Float8Matmul.forward_gemm = counted
        try:
            model_parallel_seed(7)
            loss = model(ids, labels=labels).mean()
            loss.backward()
        finally:
            Float8Matmul.forward_gemm = forward_gemm
        out[compiled] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls[0],
                         dict(counters["graph_break"]), dict(counters["stats"]))
    state.destroy()
    return out


def test_compiled_layers_take_the_split_float8_gemms_and_equal_eager():
    for out in run_on_ranks(_compiled_vs_eager, 2, timeout=400):
        eager, compiled = out[False], out[True]
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
        for name, grad in eager[1].items():
            torch.testing.assert_close(compiled[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # two column-parallel linears a layer (qkv, fc1), two layers: the split path in both runs
        assert eager[2] == compiled[2] == 4, (eager[2], compiled[2])
        assert compiled[4]["unique_graphs"] >= 1 and compiled[3], (compiled[4], compiled[3])   # it compiled
        assert all("_eager_apply" in reason or "column_parallel_linear" in reason for reason in compiled[3]), \
            compiled[3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_split_gemms_equal_the_whole_float8_linear(one_rank):
    """On the GPU the split GEMMs run compiled per shape (``Float8Config.compile``): bit for bit the whole cached
    float8 linear (forward, input and weight gradients, bf16)."""
    from lightning_megatron.quantization.float8_weights import cached_float8_linear

    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 512, bias=False, params_dtype=torch.bfloat16).cuda()
    enable_fp8(layer, Float8Config())
    (cast,) = float8_weight_casts(layer)
    cast.refresh()
    cast.armed, cast.stale, cast.graphed = True, False, True
    x = (torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16) * 3).requires_grad_()
    g = torch.randn(2, 64, 512, device="cuda", dtype=torch.bfloat16) * 1e-2
    ref = cached_float8_linear(x, layer.weight, cast.data, cast.data_t, cast.scale, cast.pow2, False)
    ref.backward(g)
    ref_grads, x.grad, layer.weight.grad = (x.grad.clone(), layer.weight.grad.clone()), None, None
    gemms = layer.float8.split_gemms(x, layer.weight, 128)
    assert gemms is layer.float8
    with torch.no_grad():   # as inside the column linear's autograd function, whose pieces these are
        out, saved = gemms.forward_gemm(x, layer.weight)
        grad_x, operand = gemms.input_grad_gemm(g, layer.weight, saved)
        grad_w = gemms.weight_grad_gemm(operand, x, layer.weight, saved)
    assert torch.equal(out, ref) and torch.equal(grad_x, ref_grads[0]) and torch.equal(grad_w, ref_grads[1])
    assert torch.equal(gemms.grad_operand(g, saved)[0], operand[0])
