"""``TransformerConfig(gradient_accumulation_fusion="auto")``, the default
(``transformer/grad_accumulation_default.py``): on in compiled layers outside CUDA graphs, off in eager layers and
under CUDA graphs and in float8 linears; ``True`` and ``False`` kept; bad values refused by name. Through the Trainer:
tests/integration/strategy/test_grad_accumulation_fusion.py."""

import pytest

from lightning_megatron.testing import run_on_ranks


@pytest.mark.parametrize("bad", ["yes", 1, 0, None])
def test_bad_gradient_accumulation_fusion_named(bad):
    from lightning_megatron.transformer import TransformerConfig

    with pytest.raises(ValueError, match="gradient_accumulation_fusion must be True, False or 'auto'"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, gradient_accumulation_fusion=bad)


def _gpt(moe=False, **overrides):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.moe import MoEConfig
    from lightning_megatron.transformer import TransformerConfig

    cfg = dict(num_layers=3, hidden_size=16, num_attention_heads=4, activation="swiglu", normalization="RMSNorm",
               add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)
    if moe:   # layers 1 and 3 MoE (with shared experts), layer 2 dense
        cfg.update(moe=MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, shared_expert_ffn_hidden_size=8),
                   moe_layer_freq=2)
    cfg.update(overrides)
    return GPTModel(TransformerConfig(**cfg), 64, 8)


def _fused(model):
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return {name: m.accumulate_weight_grads for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def _decisions():
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer.compile import compile_layers
    from lightning_megatron.transformer.grad_accumulation_default import resolve_gradient_accumulation_fusion

    ParallelState(ParallelLayout(1)).activate()
    out = {}
    model = _gpt()
    out["built"] = _fused(model)                                           # "auto" alone: off
    out["eager"] = (resolve_gradient_accumulation_fusion(model, cuda_graphs=False), _fused(model))
    compile_layers(model, backend="eager")
    out["compiled"] = (resolve_gradient_accumulation_fusion(model, cuda_graphs=False), _fused(model))
    out["compiled-graphs"] = (resolve_gradient_accumulation_fusion(model, cuda_graphs=True), _fused(model))
    for setting in (True, False):
        model = _gpt(gradient_accumulation_fusion=setting)
        compile_layers(model, backend="eager")
        out[setting] = (resolve_gradient_accumulation_fusion(model, cuda_graphs=setting), _fused(model))
    model = _gpt(moe=True)
    compile_layers(model, backend="eager")   # an MoE layer compiles its attention block only
    for layer in (0, 2):   # the shared experts' linears (False: not the config's) as if they were "auto"
        shared = model.decoder.layers[layer].mlp.shared_experts
        shared.fc1.grad_accumulation_fusion = shared.fc2.grad_accumulation_fusion = "auto"
    out["moe"] = (resolve_gradient_accumulation_fusion(model, cuda_graphs=False), _fused(model))
    from lightning_megatron.quantization.float8 import Float8Config, enable_fp8

    model = _gpt()   # the fc2s in float8 (the strategy converts before it compiles and decides)
    enable_fp8(model, Float8Config(emulate=True, compile=False, module_filter_fn=lambda m, n: n.endswith("fc2")))
    compile_layers(model, backend="eager")
    out["float8"] = (resolve_gradient_accumulation_fusion(model, cuda_graphs=False), _fused(model))
    return out


def test_auto_fuses_in_compiled_layers_outside_cuda_graphs_only():
    out = run_on_ranks(_decisions, 1, timeout=120)[0]
    names = list(out["built"])
    assert len(names) == 12, names                     # qkv, proj, fc1, fc2 in each of three layers
    assert not any(out["built"].values())
    assert out["eager"] == (0, out["built"])            # eager layers: off
    assert out["compiled"] == (12, dict.fromkeys(names, True))
    assert out["compiled-graphs"] == (0, dict.fromkeys(names, False))   # and back off under CUDA graphs
    assert out[True] == (0, dict.fromkeys(names, True))     # asked for: kept (refused at a capture, as before)
    assert out[False] == (0, dict.fromkeys(names, False))
    turned_on, moe = out["moe"]
    attention = {n: v for n, v in moe.items() if ".attention." in n}
    assert len(attention) == 6 and all(attention.values()), moe
    dense_mlp = {n: v for n, v in moe.items() if n.startswith("decoder.layers.1.mlp.")}
    assert len(dense_mlp) == 2 and all(dense_mlp.values()), moe
    assert turned_on == 8 and not any(v for n, v in moe.items() if n not in attention and n not in dense_mlp), moe
    turned_on, float8 = out["float8"]   # torchao's float8 matmul forms the fc2s' weight gradients itself
    assert turned_on == 9 and float8 == {n: not n.endswith("fc2") for n in names}, float8
