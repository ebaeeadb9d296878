"""tp_comm_overlap: the sequence-parallel linears whose gathers and reduce-scatters go round a ring in chunks equal
the plain sequence-parallel path (output, input gradient, weight and bias gradients), float32, at tp 2 and 4,
and the MLP and attention built from them; the option is refused where it cannot apply."""

import pytest
import torch

from lightning_megatron.parallel import ParallelConfig
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.transformer.attention import SelfAttention
from lightning_megatron.transformer.mlp import MLP
from helpers.tp_utils import tp_state

S, B, H = 8, 3, 16


def _same_module_both_ways(build, x_full):
    """(max |difference| of output, input gradient and every parameter gradient) between ``build(overlap=True)``
    and ``build(overlap=False)`` on this rank's sequence shard, same weights."""
    state = tp_state()
    torch.manual_seed(0)
    plain = build(False)
    torch.manual_seed(0)
    overlapped = build(True)
    overlapped.load_state_dict(plain.state_dict())
    x = x_full.chunk(state.tp_size, 0)[state.tp_rank]
    out = {}
    for name, module in (("plain", plain), ("overlap", overlapped)):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y = y[0] if isinstance(y, tuple) else y
        upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + state.tp_rank))
        (y * upstream).sum().backward()
        out[name] = (y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()})
    (y0, gx0, gp0), (y1, gx1, gp1) = out["plain"], out["overlap"]
    diffs = {"out": (y0 - y1).abs().max().item(), "grad_x": (gx0 - gx1).abs().max().item()}
    diffs.update({n: (gp0[n] - gp1[n]).abs().max().item() for n in gp0})
    scale = max(y0.abs().max().item(), gx0.abs().max().item())
    return diffs, scale, repr(overlapped)


def _linears(kind, bias):
    x_full = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    if kind == "column":
        return _same_module_both_ways(lambda overlap: ColumnParallelLinear(
            H, 2 * H, bias=bias, sequence_parallel=True, comm_overlap=overlap), x_full)

    def row(overlap):
        return torch.nn.Sequential(
            ColumnParallelLinear(H, 2 * H, bias=bias, sequence_parallel=True, comm_overlap=overlap),
            RowParallelLinear(2 * H, H, bias=bias, input_is_parallel=True, sequence_parallel=True,
                              comm_overlap=overlap))
    return _same_module_both_ways(row, x_full)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind, bias", [("column", True), ("row", False), ("row", True)])
def test_overlapped_linears_equal_the_plain_sequence_parallel_path(world, kind, bias):
    for diffs, scale, text in run_on_ranks(_linears, world, kind, bias, timeout=120):
        assert "comm_overlap=True" in text
        assert scale > 1e-3
        assert max(diffs.values()) <= 1e-6 * max(scale, 1.0), diffs


def _blocks(attention):
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=32,
                               sequence_parallel=True, position_embedding_type="rope", num_query_groups=2,
                               activation="swiglu", normalization="RMSNorm", add_bias_linear=False,
                               attention_dropout=0.0, hidden_dropout=0.0)
    x_full = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))

    def build(overlap):
        cfg = TransformerConfig(**{**config.__dict__, "tp_comm_overlap": overlap})
        return SelfAttention(cfg, layer_number=1) if attention else MLP(cfg)
    return _same_module_both_ways(build, x_full)


@pytest.mark.parametrize("world, attention", [(2, False), (2, True), (4, True)],
                         ids=["mlp-tp2", "attention-tp2", "attention-tp4-kv-heads-shared"])
def test_overlapped_mlp_and_attention_equal_the_plain_path(world, attention):
    for diffs, scale, _ in run_on_ranks(_blocks, world, attention, timeout=120):
        assert max(diffs.values()) <= 1e-6 * max(scale, 1.0), diffs


def _fp8_refused():
    from lightning_megatron.quantization.float8 import enable_fp8

    tp_state()
    layer = ColumnParallelLinear(H, 2 * H, sequence_parallel=True, comm_overlap=True)
    with pytest.raises(ValueError, match="fp8 does not combine with tp_comm_overlap=True"):
        enable_fp8(torch.nn.Sequential(layer), "tensorwise")   # refused before torchao or the GPU are checked
    return True


def test_the_option_is_refused_where_it_cannot_apply():
    assert run_on_ranks(_fp8_refused, 2, timeout=60) == [True, True]
    with pytest.raises(ValueError, match="tp_comm_overlap=True .* needs sequence_parallel=True"):
        ParallelConfig(tensor_model_parallel_size=2, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="tp_comm_overlap=True does not combine with pipeline_schedule='zb-h1'"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True,
                       pipeline_schedule="zb-h1", tp_comm_overlap=True)
