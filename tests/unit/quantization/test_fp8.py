"""FP8 training through torchao (``lightning_megatron.quantization.float8``): the option's errors, which layers convert,
what each tensor-parallel rank's scales are computed over (CPU, torchao's emulation), and on a GPU:
equality with torchao's ``Float8Linear``, closeness to bfloat16, CUDA-graph capture."""

import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.quantization.float8 import Float8Config, enable_fp8, fp8_config
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

EMULATED = dict(compile=False, emulate=True)


def tiny_gpt(gpt_kwargs=None, **overrides):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**{**base, **overrides}), 128, 32, **(gpt_kwargs or {}))


# -- the option ---------------------------------------------------------------------------------------------


def test_option_validation():
    assert fp8_config(None) is None
    assert fp8_config("rowwise") == Float8Config("rowwise")
    with pytest.raises(ValueError, match=r"fp8 recipe 'delayed' is not one of \['tensorwise', 'rowwise'\]"):
        fp8_config("delayed")
    with pytest.raises(ValueError, match="fp8=8 must be None"):
        fp8_config(8)
    with pytest.raises(ValueError, match="Float8Config.compile must be True or False"):
        Float8Config(compile="yes")
    assert enable_fp8(nn.Sequential(nn.Linear(16, 16)), None) == []


def test_without_torchao_the_option_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"fp8='tensorwise' .*torchao is not installed.*lightning-megatron\[fp8\]"):
        enable_fp8(nn.Sequential(nn.Linear(16, 16)), "tensorwise")


def test_without_a_float8_gpu_the_option_says_what_it_needs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"fp8='rowwise' needs a CUDA GPU with compute capability >= 8.9.*"
                                           r"no CUDA GPU is available"):
        enable_fp8(nn.Sequential(nn.Linear(16, 16)), "rowwise")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"NVIDIA A100\) has compute capability 8.0"):
        enable_fp8(nn.Sequential(nn.Linear(16, 16)), "tensorwise")


# -- which layers convert -----------------------------------------------------------------------------------


def test_enable_fp8_converts_exactly_the_linear_layers(one_rank):
    from torchao.float8.float8_linear import Float8Linear

    class WithHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = tiny_gpt()
            self.head = nn.Linear(64, 32)       # converted (torchao's Float8Linear)
            self.labels = nn.Linear(64, 3)      # 3 is not a multiple of 16: stays, with a warning

    model = WithHeads()
    parallel = {n for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    assert len(parallel) == 2 * 4   # qkv, proj, fc1, fc2 per layer
    params = dict(model.named_parameters())
    with pytest.warns(UserWarning, match=r"labels \(Linear, local weight 3x64\)"):
        names = enable_fp8(model, Float8Config("tensorwise", **EMULATED))
    assert set(names) == parallel | {"head"} and len(names) == len(parallel) + 1
    assert isinstance(model.head, Float8Linear) and type(model.labels) is nn.Linear
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            assert repr(module.float8) == "tensorwise (emulated)" and module.float8.name == name
    assert dict(model.named_parameters()).keys() == params.keys()              # checkpoints unchanged
    assert all(p is params[n] for n, p in model.named_parameters())            # the optimizer's tensors too


def test_module_filter_and_misaligned_parallel_layers(one_rank):
    model = tiny_gpt()
    names = enable_fp8(model, Float8Config("rowwise", module_filter_fn=lambda m, n: not n.endswith("fc2"),
                                           **EMULATED))
    assert len(names) == 6 and not any(n.endswith("fc2") for n in names)
    odd = nn.Sequential(ColumnParallelLinear(24, 32), RowParallelLinear(32, 32))
    with pytest.warns(UserWarning, match=r"0 \(ColumnParallelLinear, local weight 32x24\)"):
        assert enable_fp8(odd, Float8Config(**EMULATED)) == ["1"]
    assert odd[0].float8 is None


def test_tokens_must_be_a_multiple_of_16_for_the_backward(one_rank):
    layer = ColumnParallelLinear(32, 32)
    enable_fp8(nn.Sequential(layer), Float8Config(**EMULATED))
    with pytest.raises(ValueError, match=r"^0: fp8='tensorwise' needs .* 6 tokens"):
        layer(torch.randn(3, 2, 32, requires_grad=True))
    with torch.no_grad():
        assert layer(torch.randn(3, 2, 32)).shape == (3, 2, 32)   # forward only: any token count


def test_emulated_float8_gpt_trains_like_high_precision(one_rank):
    ref, model = tiny_gpt(), tiny_gpt()
    enable_fp8(model, Float8Config("tensorwise", **EMULATED))
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 128, (2, 32), generator=gen), torch.randint(0, 128, (2, 32), generator=gen)
    losses = []
    for m in (ref, model):
        loss = m(ids, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters()])
    g_fp8 = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.nn.functional.cosine_similarity(g_ref, g_fp8, dim=0) > 0.99


def test_compile_layers_and_power_of_2_scales_options(one_rank, monkeypatch):
    with pytest.raises(ValueError, match="Float8Config.compile_layers must be True or False"):
        Float8Config(compile_layers=1)
    with pytest.raises(ValueError, match=r"compile_layers=True\) .* compile=False .* set compile=True"):
        Float8Config(compile=False, compile_layers=True)
    with pytest.raises(ValueError, match="Float8Config.round_scales_to_power_of_2 must be True, False or None"):
        Float8Config(round_scales_to_power_of_2="yes")
    assert Float8Config(round_scales_to_power_of_2=True).torchao_config().round_scales_to_power_of_2
    assert not Float8Config().torchao_config().round_scales_to_power_of_2            # the recipe's default
    assert Float8Config("rowwise").torchao_config().round_scales_to_power_of_2
    assert not Float8Config("rowwise", round_scales_to_power_of_2=False).torchao_config().round_scales_to_power_of_2

    model = tiny_gpt()
    names = enable_fp8(model, Float8Config(emulate=True, compile_layers=True))
    assert len(names) == 8
    layers = list(model.decoder.layers)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)   # compiled in place
    assert model._compiled_call_impl is None and model.embedding._compiled_call_impl is None
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in tiny_gpt().named_parameters()]
    with pytest.warns(UserWarning, match="holds no TransformerLayer with a float8 layer"):
        enable_fp8(nn.Sequential(ColumnParallelLinear(32, 32)), Float8Config(emulate=True, compile_layers=True))

    import lightning_megatron.parallel as parallel
    monkeypatch.setattr(parallel, "get_parallel_state", lambda: types.SimpleNamespace(tp_size=2, cp_size=1))
    with pytest.raises(ValueError, match=r"compile_layers=True\) .* size 1 only .* tp=2, cp=1: use compile_layers"):
        enable_fp8(tiny_gpt(), Float8Config(emulate=True, compile_layers=True))


# -- what each tensor-parallel rank's scales are computed over (TP=2, emulated) -------------------------------


def _float8_linear_of(weight, bias, recipe):
    """torchao's own float8 layer holding ``weight`` (emulated, as our layers in this test)."""
    from torchao.float8 import convert_to_float8_training

    holder = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None))
    with torch.no_grad():
        holder[0].weight.copy_(weight)
        if bias is not None:
            holder[0].bias.copy_(bias)
    config = Float8Config(recipe, **EMULATED).torchao_config()
    return convert_to_float8_training(holder, config=config)[0]


def _tp2_scales(sequence_parallel):
    from helpers.tp_utils import tp_state

    state = tp_state()
    return {recipe: _tp2_checks(state, recipe, sequence_parallel) for recipe in ("tensorwise", "rowwise")}


def _tp2_checks(state, recipe, sequence_parallel):
    from lightning_megatron.tensor_parallel.mappings import all_reduce

    r, group = state.tp_rank, state.tp_group
    S, B, H, F = 8, 2, 32, 64
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(S, B, H, generator=gen)
    g_mid = torch.randn(S, B, F, generator=gen)     # upstream gradient of the column output (full)
    torch.manual_seed(1)
    fc1 = ColumnParallelLinear(H, F, sequence_parallel=sequence_parallel)
    fc2 = RowParallelLinear(F, H, bias=False, input_is_parallel=True, sequence_parallel=sequence_parallel)
    enable_fp8(nn.Sequential(fc1, fc2), Float8Config(recipe, **EMULATED))
    checks = {}

    # column-parallel: the whole input, this rank's weight rows
    x = (x_full.chunk(2, 0)[r] if sequence_parallel else x_full).clone().requires_grad_()
    out = fc1(x)
    g_local = g_mid.chunk(2, -1)[r]
    out.backward(g_local)
    ref = _float8_linear_of(fc1.weight.detach(), fc1.bias.detach(), recipe)
    x_ref = x_full.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.backward(g_local)
    checks["column out = Float8Linear(shard)"] = torch.equal(out, out_ref)
    checks["column weight grad"] = torch.equal(fc1.weight.grad, ref.weight.grad)
    x_grad_ref = all_reduce(x_ref.grad.clone(), group)           # the partial input gradients, summed over tp
    checks["column input grad"] = torch.equal(x.grad, x_grad_ref.chunk(2, 0)[r] if sequence_parallel else x_grad_ref)
    if recipe == "rowwise":   # whole rows along the contracted dim: exactly the TP=1 scales and numbers
        full = _float8_linear_of(_gather_rows(fc1.weight.detach(), group), _gather_rows(fc1.bias.detach(), group),
                                 recipe)
        with torch.no_grad():
            checks["column rowwise = TP=1 slice"] = torch.equal(out.detach(), full(x_full).chunk(2, -1)[r])

    # row-parallel: this rank's slice of the features and of the weight columns
    h = torch.randn(S, B, F, generator=gen).chunk(2, -1)[r].clone().requires_grad_()
    y = fc2(h)
    g_out = torch.randn(S, B, H, generator=gen)
    y.backward(g_out.chunk(2, 0)[r] if sequence_parallel else g_out)
    ref2 = _float8_linear_of(fc2.weight.detach(), None, recipe)
    h_ref = h.detach().clone().requires_grad_()
    partial = ref2(h_ref)
    partial.backward(g_out)   # backward of the reduce (-scatter) hands every rank the whole gradient
    y_ref = all_reduce(partial.detach().clone(), group)
    y_mine = y_ref.chunk(2, 0)[r] if sequence_parallel else y_ref
    checks["row out = sum of Float8Linear(shard)"] = torch.equal(y, y_mine)
    checks["row weight grad"] = torch.equal(fc2.weight.grad, ref2.weight.grad)
    checks["row input grad"] = torch.equal(h.grad, h_ref.grad)
    return checks


def _gather_rows(shard, group):
    """The TP=1 tensor of a column-parallel weight / bias (contiguous row blocks, rank by rank)."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_scales_are_the_shards_own(sequence_parallel):
    from lightning_megatron.testing import run_on_ranks

    for per_recipe in run_on_ranks(_tp2_scales, 2, sequence_parallel, timeout=120):
        for recipe, checks in per_recipe.items():
            assert len(checks) == (7 if recipe == "rowwise" else 6)
            assert all(checks.values()), (recipe, {k: v for k, v in checks.items() if not v})


# -- on a GPU -----------------------------------------------------------------------------------------------

RECIPES = ["tensorwise", "rowwise"]


def _bf16(module):
    return module.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_parallel_layers_equal_torchao_float8_linear(one_rank, recipe):
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    col, row = _bf16(ColumnParallelLinear(256, 512)), _bf16(RowParallelLinear(512, 256, input_is_parallel=True))
    ref = _bf16(nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256)))
    with torch.no_grad():
        for ours, theirs in ((col, ref[0]), (row, ref[1])):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
    enable_fp8(nn.Sequential(col, row), Float8Config(recipe, compile=False))
    convert_to_float8_training(ref, config=Float8Config(recipe).torchao_config())
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = row(col(xa)), ref(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    for ours, theirs in ((col, ref[0]), (row, ref[1])):
        assert torch.equal(ours.weight.grad, theirs.weight.grad) and torch.equal(ours.bias.grad, theirs.bias.grad)
    bf16 = nn.functional.linear(nn.functional.linear(x, col.weight, col.bias), row.weight, row.bias)
    assert (ya - bf16).float().norm() / bf16.float().norm() < 0.15     # float8 error, not a wrong result


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_tiny_gpt_in_float8_is_close_to_bfloat16(one_rank, recipe):
    ref, model = _bf16(tiny_gpt(hidden_size=128)), _bf16(tiny_gpt(hidden_size=128))
    enable_fp8(model, Float8Config(recipe, compile=False))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 32), generator=gen).cuda()
    labels = torch.randint(0, 128, (2, 32), generator=gen).cuda()
    losses = []
    for m in (ref, model):
        loss = m(ids, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    g_ref = torch.cat([p.grad.float().flatten() for p in ref.parameters()])
    g_fp8 = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    assert torch.nn.functional.cosine_similarity(g_ref, g_fp8, dim=0) > 0.98


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_compiled_float8_layers_capture_in_a_cuda_graph(one_rank, recipe):
    """The default path (torch.compile'd casts): no host sync, so forward+backward capture; replay = eager."""
    torch.manual_seed(0)
    col, row = _bf16(ColumnParallelLinear(256, 512)), _bf16(RowParallelLinear(512, 256, input_is_parallel=True))
    enable_fp8(nn.Sequential(col, row), Float8Config(recipe))
    params = [col.weight, col.bias, row.weight, row.bias]

    def step(x, g):
        out = row(torch.nn.functional.gelu(col(x)))
        out.backward(g)
        return out

    static_x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):   # compiles, then warm
            step(static_x, static_g)
    torch.cuda.current_stream().wait_stream(side)
    for p in params + [static_x]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x, static_g)
    x, g = torch.randn_like(static_x), torch.randn_like(static_g)
    with torch.no_grad():
        static_x.copy_(x)
        static_g.copy_(g)
    graph.replay()
    replayed = [static_out.clone(), static_x.grad.clone()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x_eager = x.clone().requires_grad_()
    eager = [step(x_eager, g).detach(), x_eager.grad] + [p.grad for p in params]
    for a, b in zip(replayed, eager):   # the same kernels: equal up to a cuBLAS algorithm choice
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("output_layer", [False, True], ids=["linears", "output-layer-too"])
def test_gpu_float8_gpt_under_partial_cuda_graphs_trains_like_eager(one_rank, output_layer):
    """The library's per-layer graphs (``cuda_graph="partial"``) around compiled float8 layers, and with the float8
    output layer (its compiled casts run eagerly after the replayed layers)."""
    from lightning_megatron.distributed.config import GradientConfig
    from lightning_megatron.distributed.gradients import GradientState
    from lightning_megatron.engine import StepEngine
    from lightning_megatron.tensor_parallel import model_parallel_seed

    def train(cuda_graph):
        model_parallel_seed(1234)
        model = _bf16(tiny_gpt(dict(fused_cross_entropy=True), hidden_size=128))
        enable_fp8(model, Float8Config("tensorwise", output_layer=output_layer))
        assert (model.output_float8 is not None) == output_layer
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = StepEngine(model, one_rank, device=torch.device("cuda"), micro_batch_size=2, cuda_graph=cuda_graph,
                            cuda_graph_warmup_steps=2)
        grads = GradientState(list(model.parameters()), one_rank, GradientConfig(), optimizers=[opt], modules=[model])
        gen = torch.Generator().manual_seed(0)
        batch = {"ids": torch.randint(0, 128, (4, 32), generator=gen).cuda(),
                 "labels": torch.randint(0, 128, (4, 32), generator=gen).cuda()}

        def last_stage(mb):
            loss = model(mb["ids"], labels=mb["labels"]).float().mean()
            return loss, loss.detach()

        losses = []
        for _ in range(5):
            grads.zero()
            grads.before_schedule()
            result = engine.run(batch, last_stage, no_sync=grads.schedule_no_sync)
            grads.finalize([model])
            grads.expose()
            opt.step()
            grads.after_optimizer_step()
            losses.append(float(result.loss))
        stats = engine.partial_graphs.stats() if engine.partial_graphs is not None else None
        engine.close()
        return losses, stats

    eager, _ = train(None)
    graphed, stats = train("partial")
    assert stats and stats["graphs"] > 0
    assert graphed == pytest.approx(eager, rel=1e-3)
    assert eager[-1] < eager[0]


def _fit_with_fp8_on_cpu():
    import lightning as L

    from lightning_megatron import MegatronStrategy
    from helpers.strategy_utils import TinyGPT, TokenData

    trainer = L.Trainer(strategy=MegatronStrategy(fp8="tensorwise"), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(TinyGPT(), torch.utils.data.DataLoader(TokenData(n=8), batch_size=4))
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_strategy_fp8_option_is_checked_at_init_and_setup():
    """``MegatronStrategy(fp8=...)``: a bad value fails at construction; on a CPU the fit stops at setup with the
    error that names the option (before any step). The fit runs in its own process: it builds process groups."""
    from lightning_megatron import MegatronStrategy
    from lightning_megatron.testing import run_on_ranks

    with pytest.raises(ValueError, match="fp8 recipe 'bogus' is not one of"):
        MegatronStrategy(fp8="bogus")
    message = run_on_ranks(_fit_with_fp8_on_cpu, 1, timeout=120)[0]
    assert "fp8='tensorwise'" in message, message


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_compiled_layers_train_like_compiled_matmuls(one_rank, recipe):
    """``compile_layers=True`` (whole layers compiled, casts fused with their neighbours) computes what the
    per-matmul compilation computes, up to bf16 rounding of the fused neighbours, over a few AdamW steps."""
    import torch._dynamo

    torch._dynamo.reset()
    models = [_bf16(tiny_gpt(hidden_size=128, num_layers=3)) for _ in range(2)]
    enable_fp8(models[0], Float8Config(recipe))
    enable_fp8(models[1], Float8Config(recipe, compile_layers=True))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 32), generator=gen).cuda()
    labels = torch.randint(0, 128, (2, 32), generator=gen).cuda()
    losses = [[], []]
    for i, m in enumerate(models):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(4):
            loss = m(ids, labels=labels).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert losses[1][-1] < losses[1][0]
    from torch._dynamo.utils import counters
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
