"""``overlap_param_gather`` with compiled layers: the waits for the gathered parameters stay outside the compiled
bodies (one wait per transformer layer, before its forward), so dynamo traces the same graphs as without the
overlap. A wait per norm and linear, inside the bodies, split every layer's graph at each of them: the GPT-1.3B
step at DP4 on H200s ran its norms, GeLU and concatenations eagerly (benchmarks/RESULTS.md, thirteenth session)."""

import pytest
import torch
from torch import nn

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import fit_tiny_gpt

DISTOPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=600,
               compile_layers=dict(backend="eager"))


def _fit_and_count(overlap_param_gather):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = fit_tiny_gpt(dict(DISTOPT, overlap_param_gather=overlap_param_gather), max_steps=3)
    return out["losses"], dict(counters["stats"]), {str(k): v for k, v in counters["graph_break"].items()}


def test_overlapped_gathers_leave_the_compiled_graphs_whole():
    plain, overlapped = (run_on_ranks(_fit_and_count, 2, gather, timeout=300)[0] for gather in (False, True))
    assert not overlapped[2], overlapped[2]   # no graph break (a wait inside a body is one per norm and linear)
    assert overlapped[1]["unique_graphs"] == plain[1]["unique_graphs"], (overlapped[1], plain[1])
    assert overlapped[0] == pytest.approx(plain[0], rel=1e-6, abs=1e-7)


def _hooks_of(world_size):
    import torch.distributed as dist

    from lightning_megatron.distributed import DataParallelGrads, DistributedOptimizer
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer.layer import TransformerLayer

    state = ParallelState(ParallelLayout(dist.get_world_size())).activate()
    model = GPTModel(TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2), 32, 8)
    grads = DataParallelGrads(list(model.parameters()), dense_group=state.dp_group, divisor=world_size,
                              overlap_grad_reduce=True, bucket_size=300, shard=True)
    DistributedOptimizer([torch.optim.SGD(model.parameters(), lr=0.1)], grads, modules=[model],
                         overlap_param_gather=True)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    inside = {id(m) for layer in layers for m in layer.modules() if m is not layer}
    hooked = {id(m) for m in model.modules() if m._forward_pre_hooks}
    state.destroy()
    return (all(id(layer) in hooked for layer in layers), not (hooked & inside),
            any(isinstance(m, nn.Embedding) and id(m) in hooked for m in model.modules()))


def test_a_layer_waits_once_for_all_its_parameters_and_its_submodules_never():
    layers_wait, nothing_inside_waits, embedding_waits = run_on_ranks(_hooks_of, 2, 2, timeout=120)[0]
    assert layers_wait and nothing_inside_waits and embedding_waits


def _hooks_of_a_compiled_user_module(world_size):
    import torch.distributed as dist

    from lightning_megatron.distributed import DataParallelGrads, DistributedOptimizer
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    state = ParallelState(ParallelLayout(dist.get_world_size())).activate()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    block.compile(backend="eager")
    model = nn.Sequential(nn.Linear(8, 8), block)
    grads = DataParallelGrads(list(model.parameters()), dense_group=state.dp_group, divisor=world_size,
                              overlap_grad_reduce=True, bucket_size=40, shard=True)
    DistributedOptimizer([torch.optim.SGD(model.parameters(), lr=0.1)], grads, modules=[model],
                         overlap_param_gather=True)
    hooked = [name for name, m in model.named_modules() if m._forward_pre_hooks]
    state.destroy()
    return hooked


def test_a_module_compiled_by_the_user_waits_once_too():
    assert run_on_ranks(_hooks_of_a_compiled_user_module, 2, 2, timeout=120)[0] == ["0", "1"]
