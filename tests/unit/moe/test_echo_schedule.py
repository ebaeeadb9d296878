"""When ECHO plans (``moe/echo_schedule.py``): the host rule is the planner's, the schedule changes only between
steps, and over real EP groups (gloo) a layer that skips its plan routes over its home experts, watches the loads,
plans again after a step that would have spilled, and equals the layer without ECHO whichever path it takes.
Through the Trainer: tests/integration/strategy/test_moe_gpt.py."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.moe import MoEConfig, MoELayer
from lightning_megatron.moe.echo import any_rank_spills, gen_intermediate
from lightning_megatron.moe.echo_schedule import EchoSchedule
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks
from helpers.moe_utils import global_weights

S, B, H, FFN, E, K = 8, 2, 8, 8, 8, 2


@pytest.mark.parametrize("tolerance", [0.0, 0.25, 1.0])
def test_the_host_rule_is_the_planners(tolerance):
    """``any_rank_spills`` on the per-rank loads is True exactly when ``gen_intermediate`` spills something."""
    gen = torch.Generator().manual_seed(11)
    seen = set()
    for R, E_ in ((2, 4), (4, 8)):
        for _ in range(50):
            counts = torch.randint(0, 30, (R, E_), generator=gen)
            counts[0, : E_ // R] += torch.randint(0, 40 * int(torch.randint(1, 6, (1,), generator=gen)), (E_ // R,),
                                                  generator=gen)
            loads = counts.sum(dim=0).view(R, -1).sum(dim=1).tolist()
            spill, _, _ = gen_intermediate(counts, tolerance=tolerance)
            assert any_rank_spills(loads, tolerance) == bool(spill.sum() > 0), (loads, tolerance)
            seen.add(any_rank_spills(loads, tolerance))
        balanced = torch.full((R, E_), 7)
        assert not any_rank_spills(balanced.sum(dim=0).view(R, -1).sum(dim=1).tolist(), tolerance)
        assert int(gen_intermediate(balanced, tolerance=tolerance)[0].sum()) == 0
    assert seen == ({True, False} if tolerance else {True})   # both outcomes met (at 0, any imbalance spills)


def test_the_schedule_changes_between_steps_only():
    schedule = EchoSchedule()
    assert schedule.plans                                   # the first step plans
    schedule.next_step()
    assert schedule.plans                                   # nothing observed: plan again
    schedule.saw_plan(False)
    schedule.saw_plan(None)                                 # not read: no observation
    assert schedule.plans                                   # unchanged within the step
    schedule.next_step()
    assert not schedule.plans                               # no slot used all step: skip the next
    schedule.saw_loads([10, 10], 0.25)
    schedule.saw_loads([13, 7], 0.25)                             # 13 > 10 * 1.25: would spill
    schedule.saw_loads([10, 10], 0.25)
    assert not schedule.plans
    schedule.next_step()
    assert schedule.plans
    schedule.saw_plan(True)
    schedule.next_step()
    assert schedule.plans
    schedule.saw_loads([12, 8], 0.25)                             # within 1.25x
    schedule.next_step()
    assert not schedule.plans


def _layer_steps(skew, tolerance):
    """Three 'steps' of one forward and backward each, ``next_step`` between them, for the ECHO layer and the plain
    one: which path each step took, the loads it saw, and the outputs and gradients of both layers."""
    state = ParallelState(ParallelLayout(dist.get_world_size(), ep=dist.get_world_size())).activate()
    gen = torch.Generator().manual_seed(5 + dist.get_rank())
    x0, g = torch.randn(S, B, H, generator=gen) + 0.5, torch.randn(S, B, H, generator=gen)
    layers = {}
    for spare in (0, 1):
        torch.manual_seed(99)
        layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, topk=K, aux_loss_coeff=0.1,
                                   num_spare_experts_per_ep_rank=spare, echo_tolerance=tolerance))
        with torch.no_grad():
            layer.router.weight[:2] += skew                 # experts 0 and 1 live on EP rank 0
        layers[spare] = layer
    plans, out = [], []
    calls = []
    offload = MoELayer.offload

    def counted(self, *args):
        calls.append(1)
        return offload(self, *args)

    MoELayer.offload = counted
    try:
        for step in range(3):
            runs = {}
            for spare, layer in layers.items():
                calls.clear()
                layer.zero_grad()
                x = x0.clone().requires_grad_()
                y = layer(x)
                (y * g).sum().backward()
                runs[spare] = {"out": y.detach(), "dx": x.grad, "grads": global_weights(layer, state, grads=True)}
                if spare:
                    plans.append((len(calls), layer.dispatcher is layer._spare_dispatcher,
                                  layer.dispatcher.meta.rows_per_ep_rank, layer.echo.needed))
                    layer.echo.next_step()
            out.append(runs)
    finally:
        MoELayer.offload = offload
    state.destroy()
    return plans, out


@pytest.mark.parametrize("skew,tolerance,expected", [
    (0.0, 100.0, [True, False, False]),    # within any imbalance: plans once, then routes over its home experts
    (0.6, 0.25, [True, True, True]),       # skewed: every step plans
    (0.6, 100.0, [True, False, False]),
])
def test_the_layer_follows_its_schedule_and_equals_the_plain_layer(skew, tolerance, expected):
    per_rank = run_on_ranks(_layer_steps, 2, skew, tolerance, timeout=180)
    for rank, (plans, out) in enumerate(per_rank):
        assert [p[0] == 1 for p in plans] == expected, plans          # offload called (planned) or not
        assert [p[1] for p in plans] == expected, plans               # the dispatcher with the spare columns
        for planned, (_, _, loads, _) in zip(expected, plans):
            assert (loads is None) == planned, plans                  # an unplanned dispatch reads the loads
            if loads is not None:
                assert sum(loads) == 2 * S * B * K and not any_rank_spills(loads, tolerance)
        for step, runs in enumerate(out):
            plain, echo = runs[0], runs[1]
            torch.testing.assert_close(echo["out"], plain["out"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(echo["dx"], plain["dx"], atol=1e-5, rtol=1e-5)
            for key, grad in plain["grads"].items():
                torch.testing.assert_close(echo["grads"][key], grad, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"rank {rank} step {step} grad {key}: {m}")
    assert per_rank[0][0] == per_rank[1][0]   # every rank of the expert group decided alike


def _skip_then_skew():
    """A layer told to skip (``plans=False``) meets skewed routing: the dispatch's loads say it would spill, so the
    next step plans."""
    state = ParallelState(ParallelLayout(2, ep=2)).activate()
    torch.manual_seed(99)
    layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, topk=K,
                               num_spare_experts_per_ep_rank=1))
    with torch.no_grad():
        layer.router.weight[:2] += 0.6
    layer.echo.plans = False
    layer(torch.randn(S, B, H, generator=torch.Generator().manual_seed(5 + dist.get_rank())) + 0.5)
    seen = (layer.dispatcher is layer._home_dispatcher, layer.dispatcher.meta.rows_per_ep_rank, layer.echo.needed)
    layer.echo.next_step()
    state.destroy()
    return seen + (layer.echo.plans,)


def test_skewed_routing_seen_while_skipping_plans_the_next_step():
    for home, loads, needed, plans_next in run_on_ranks(_skip_then_skew, 2, timeout=120):
        assert home and loads[0] > 1.25 * sum(loads) / 2, loads
        assert needed is True and plans_next is True
