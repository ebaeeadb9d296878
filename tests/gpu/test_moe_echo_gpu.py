"""ECHO on two GPUs over NCCL: the offloading plan and the expert-weight dispatch run in one CUDA
graph (static shapes, no host sync), and a layer with spare slots equals the plain layer."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.moe import MoEConfig, MoELayer, gen_offloading_plan, home_expert_of_spare
from lightning_megatron.moe.comm import all_gather_stack
from lightning_megatron.moe.graph_replay import GraphReplay
from lightning_megatron.moe.spare_weights import weights_with_spare_slots
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks

E, K, T, H, F = 8, 2, 256, 64, 32
SPARE = 2

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA GPUs")


def _skewed_routing(seed, device):
    """Top-2 of random logits pushed towards experts 0-1 (EP rank 0): rank 0 is overloaded."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen)
    logits[:, :2] += 1.5
    probs, index = torch.softmax(logits, -1).topk(K, dim=-1)
    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, index, True)
    return routing.to(device), torch.zeros(T, E).scatter_(1, index, probs).to(device)


def _plan_and_slots(routing, probs, weight, group, ep, rank):
    counts = all_gather_stack(routing.sum(dim=0), group)                          # [ep, E]
    rerouted, rerouted_probs, offloading_map = gen_offloading_plan(routing, probs, counts, rank, ep, SPARE)
    homes = home_expert_of_spare(offloading_map)
    return (rerouted, rerouted_probs, homes) + weights_with_spare_slots([weight], homes, group, SPARE)


def _graph_case():
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    weight = torch.randn(E // ep, 3 * F, H, device=device, generator=torch.Generator(device).manual_seed(rank))
    routing, probs = _skewed_routing(10 + rank, device)
    static_routing, static_probs = routing.clone(), probs.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                                                 # warm-up (NCCL init)
        _plan_and_slots(static_routing, static_probs, weight, group, ep, rank)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outputs = _plan_and_slots(static_routing, static_probs, weight, group, ep, rank)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    moved = []
    for seed in (20, 30, 40):                                                       # replay on new routings
        routing, probs = _skewed_routing(seed + rank, device)
        static_routing.copy_(routing)
        static_probs.copy_(probs)
        graph.replay()
        eager = _plan_and_slots(routing, probs, weight, group, ep, rank)
        for got, want in zip(outputs, eager):
            assert torch.equal(got, want)
        moved.append(int(outputs[0].sum() - outputs[0].view(T, ep, -1)[:, :, : E // ep].sum()))
    torch.cuda.synchronize()
    return moved


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_offloading_plan_and_weight_dispatch_replay_from_one_cuda_graph():
    moved = run_on_ranks(_graph_case, 2, backend="nccl", timeout=300)
    assert sum(sum(m) for m in moved) > 0, "the skewed routings should offload tokens"


def _layer_case():
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    state = ParallelState(ParallelLayout(2, ep=2)).activate()
    gen = torch.Generator().manual_seed(3)
    x0, g = (torch.randn(64, 2, H, generator=gen) + 0.5).cuda(), torch.randn(64, 2, H, generator=gen).cuda()
    results = []
    # no ECHO; ECHO offloading every imbalance (slots used, weights moved); a tolerance above the skew (no slot
    # used: the experts run on their own weights, nothing moved)
    for spare, tolerance, used in ((0, 0.0, None), (SPARE, 0.0, True), (SPARE, 100.0, False)):
        torch.manual_seed(5)
        layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=K,
                                   num_spare_experts_per_ep_rank=spare, echo_tolerance=tolerance), device="cuda")
        with torch.no_grad():
            layer.router.weight[:2] += 0.6
        x = x0.clone().requires_grad_()
        out = layer(x)
        (out * g).sum().backward()
        results.append((out.detach(), x.grad, layer.experts.weight1.grad, layer.experts.weight2.grad,
                        layer.router.weight.grad))
        assert layer._plan.num_graphs == (1 if spare else 0)      # the plan replayed from its own graph
        assert layer.dispatcher.meta.spare_slots_used is used
    state.destroy()
    return [tuple(t.cpu() for t in run) for run in zip(*results)]


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_echo_layer_equals_the_unoffloaded_layer_over_nccl():
    for runs in run_on_ranks(_layer_case, 2, backend="nccl", timeout=300):
        for plain, echo, held in runs:
            torch.testing.assert_close(echo, plain, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(held, plain, atol=1e-4, rtol=1e-4)


def _cumulative(x, y, *, scale):
    return (x.cumsum(0) * scale + y, (x > 0).sum(0, keepdim=True))


@pytest.mark.gpu
def test_gpu_graph_replay_equals_the_function_and_hands_out_fresh_outputs():
    replay = GraphReplay(_cumulative, max_signatures=2)
    gen = torch.Generator().manual_seed(0)
    seen = []
    for shape in [(5, 3), (5, 3), (7, 3), (5, 3), (9, 3)]:
        x, y = torch.randn(shape, generator=gen).cuda(), torch.randn(shape, generator=gen).cuda()
        got = replay(x, y, scale=2)
        want = _cumulative(x, y, scale=2)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        seen.append((got[0], want[0]))
    assert replay.num_graphs == 2                         # (5, 3) and (7, 3); (9, 3) ran eagerly
    for got, want in seen:                                # earlier outputs were not overwritten by replays
        assert torch.equal(got, want)
    replay(torch.ones(5, 3).cuda(), torch.ones(5, 3).cuda(), scale=3)
    assert replay.num_graphs == 2                         # a new constant is a new signature: over the limit


def _shifted(x, *, shift):
    doubled = x * 2            # intermediates: shared between the graphs of both instances
    return (doubled + shift, doubled.sum(0, keepdim=True))


@pytest.mark.gpu
def test_gpu_graph_replays_of_several_instances_share_a_pool_safely():
    first, second = GraphReplay(_shifted), GraphReplay(_shifted)
    gen = torch.Generator().manual_seed(1)
    kept = []
    for step in range(4):                                         # interleaved replays, outputs kept alive
        for replay, shift in ((first, 1.0), (second, -3.0)):
            x = torch.randn(64, 32, generator=gen).cuda()
            got = replay(x, shift=shift)
            kept.append((got, _shifted(x, shift=shift)))
    for got, want in kept:
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert first.num_graphs == second.num_graphs == 1
