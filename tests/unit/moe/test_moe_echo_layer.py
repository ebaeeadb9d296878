"""ECHO over real EP groups (gloo): spare slots get their home expert's weights and send the
gradients back, so a layer with offloading equals the same layer without it.

The router is skewed towards experts 0 and 1 (both on EP rank 0), so rank 0 is overloaded and
the plan really moves tokens; the tests check that it did, that the per-rank load fell, and
that outputs, input gradients and the router/expert gradients are those of the un-offloaded
layer, for both dispatchers, k = 1 and 2 spare slots, with EP 2 and 4, ETP 2 and TP+SP.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.moe import MoEConfig, MoELayer
from lightning_megatron.moe.spare_weights import weights_with_spare_slots
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks
from helpers.moe_utils import global_weights

S, B, H, FFN, E, K = 8, 2, 8, 8, 8, 2
SEED, SKEW = 99, 0.6

VARIANTS = [
    dict(dispatcher="alltoall", num_spare_experts_per_ep_rank=1),
    dict(dispatcher="allgather", num_spare_experts_per_ep_rank=2, activation="gelu", shared_expert_ffn_hidden_size=8),
    dict(dispatcher="alltoall", num_spare_experts_per_ep_rank=2, score_function="sigmoid", aux_loss_coeff=0.1),
]


def _data(dp_rank):
    gen = torch.Generator().manual_seed(5 + dp_rank)
    return torch.randn(S, B, H, generator=gen) + 0.5, torch.randn(S, B, H, generator=gen)


def _load_per_ep_rank(routing_map, ep, columns_per_rank, state):
    """Rows each EP rank computes, summed over every rank that sends it tokens (tp-ep group)."""
    load = routing_map.long().sum(dim=0).view(ep, columns_per_rank).sum(dim=1)
    dist.all_reduce(load, group=state.group("tp-ep"))
    return load


def _run_variant(state, variant, sequence_parallel):
    x0, g = _data(state.dp_rank)
    if sequence_parallel:
        x0, g = x0.chunk(state.tp_size)[state.tp_rank], g.chunk(state.tp_size)[state.tp_rank]
    import lightning_megatron.moe.layer as layer_module

    exchanges = []
    exchange = layer_module.weights_with_spare_slots

    def counted(*args, **kwargs):
        exchanges.append(kwargs.get("homes_on_host") is not None)   # whether only the used slots' blocks travel
        return exchange(*args, **kwargs)

    runs = {}
    k = variant["num_spare_experts_per_ep_rank"]
    # 0: no ECHO; k: ECHO at the default tolerance; "held": a tolerance above this skew (no slot used)
    for name, spare, tolerance in ((0, 0, 0.25), (k, k, 0.25), ("held", k, 100.0)):
        cfg = MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, topk=K, echo_tolerance=tolerance,
                        sequence_parallel=sequence_parallel, **{**variant, "num_spare_experts_per_ep_rank": spare})
        torch.manual_seed(SEED)
        layer = MoELayer(cfg)
        with torch.no_grad():
            layer.router.weight[:2] += SKEW              # experts 0 and 1 live on EP rank 0
        x = x0.clone().requires_grad_()
        exchanges.clear()
        layer_module.weights_with_spare_slots = counted
        try:
            out = layer(x)
        finally:
            layer_module.weights_with_spare_slots = exchange
        (out * g).sum().backward()
        columns = E // state.ep_size + layer.num_spare
        runs[name] = {"out": out.detach(), "dx": x.grad, "weights": global_weights(layer, state, grads=False),
                      "grads": global_weights(layer, state, grads=True), "num_spare": layer.num_spare,
                      "load": _load_per_ep_rank(layer.dispatcher.meta.routing_map, state.ep_size, columns, state),
                      "exchanges": len(exchanges), "exact": list(exchanges),
                      "slots_used": layer.dispatcher.meta.spare_slots_used}
    return runs


def _run_layouts(layouts):
    world, results = dist.get_world_size(), []
    for layout in layouts:
        kwargs = {k: v for k, v in layout.items() if k != "sp"}
        state = ParallelState(ParallelLayout(world, **kwargs)).activate()
        sp = layout.get("sp", False) and state.tp_size > 1
        results.append([_run_variant(state, v, sp) for v in VARIANTS])
        state.destroy()
    return results


def check_world(world, layouts):
    results = run_on_ranks(_run_layouts, world, layouts, timeout=180)
    for li, layout in enumerate(layouts):
        for vi, variant in enumerate(VARIANTS):
            k = variant["num_spare_experts_per_ep_rank"]
            name = f"world={world} layout={layout} variant={vi}"
            for rank in range(world):
                plain, echo, held = (results[rank][li][vi][key] for key in (0, k, "held"))
                assert echo["num_spare"] == k, f"{name}: ECHO is off"
                before, after = plain["load"], echo["load"]
                assert after.sum() == before.sum(), f"{name}: rows not conserved {before} -> {after}"
                assert after.max() < before.max(), f"{name}: nothing offloaded {before} -> {after}"
                assert echo["exchanges"] == 1, f"{name}: the slots' weights did not move"
                # within the tolerance no token moves, and the all-to-all dispatcher (which reads on the host
                # whether a slot is used) moves no weights either
                assert torch.equal(held["load"], before), f"{name}: offloaded within the tolerance"
                if variant["dispatcher"] == "alltoall":
                    assert echo["slots_used"] is True and held["slots_used"] is False, name
                    assert held["exchanges"] == 0, f"{name}: weights moved with every slot unused"
                    # and it read the slots' homes at that sync: only the used slots' blocks travel
                    assert echo["exact"] == [True], f"{name}: the weights went with static splits"
                for run in (echo, held):
                    torch.testing.assert_close(run["out"], plain["out"], atol=1e-5, rtol=1e-5,
                                               msg=lambda m: f"{name} rank {rank} out: {m}")
                    torch.testing.assert_close(run["dx"], plain["dx"], atol=1e-5, rtol=1e-5,
                                               msg=lambda m: f"{name} rank {rank} dx: {m}")
                    for key, value in plain["weights"].items():
                        assert torch.equal(run["weights"][key], value), f"{name}: init of {key} differs"
                    for key, grad in plain["grads"].items():
                        torch.testing.assert_close(run["grads"][key], grad, atol=1e-5, rtol=1e-5,
                                                   msg=lambda m: f"{name} rank {rank} grad {key}: {m}")


def test_echo_layer_equals_unoffloaded_layer_on_two_ranks():
    check_world(2, [{"ep": 2}, {"tp": 2, "ep": 2, "etp": 1, "sp": True}])


def test_echo_layer_equals_unoffloaded_layer_on_four_ranks():
    # EP4; EP2 x ETP2 (slot copies carry the etp slice); TP2+SP with EP2 ETP2; dp4 with ep2 (edp 2).
    check_world(4, [{"ep": 4}, {"ep": 2, "etp": 2}, {"tp": 2, "ep": 2, "sp": True}, {"ep": 2}])


# --- the weight dispatch itself ---------------------------------------------------------------------


def _dispatch_case(k, seed, on_host=False):
    ep, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)                       # the same draws on every rank
    fulls = [torch.randn(E, 3, 2, generator=gen), torch.randn(E, 4, generator=gen)]
    homes = torch.randint(-1, E, (ep * k,), generator=gen)
    grads_out = [torch.randn(ep, E // ep + k, 3, 2, generator=gen), torch.randn(ep, E // ep + k, 4, generator=gen)]
    local = E // ep
    weights = [full[rank * local:(rank + 1) * local].clone().requires_grad_() for full in fulls]
    extended = weights_with_spare_slots(weights, homes, dist.group.WORLD, k,
                                        homes_on_host=homes.tolist() if on_host else None)
    sum((out * g[rank]).sum() for out, g in zip(extended, grads_out)).backward()
    return homes, fulls, grads_out, [out.detach() for out in extended], [w.grad for w in weights]


def _dispatch_cases(on_host):
    return [_dispatch_case(k, seed, on_host) for k in (1, 2, 3) for seed in range(3)]


@pytest.mark.parametrize("world, on_host", [(2, False), (4, False), (2, True), (4, True)],
                         ids=["2-static", "4-static", "2-homes-on-host", "4-homes-on-host"])
def test_spare_slots_hold_home_weights_and_return_gradients(world, on_host):
    """Static splits (every rank sends every slot a block) and, with the homes known on the host, only the used
    slots' blocks: the same slots and gradients."""
    results = run_on_ranks(_dispatch_cases, world, on_host, timeout=60)
    local = E // world
    for case in range(len(results[0])):
        homes, fulls, grads_out, _, _ = results[0][case]
        k = homes.numel() // world
        for full, grad_out, w in zip(fulls, grads_out, range(2)):
            # home expert e's gradient: its own rows' gradient plus that of every slot copying it
            want_grad = torch.cat([grad_out[r, :local] for r in range(world)]).clone()
            for slot, home in enumerate(homes.tolist()):
                if home >= 0:
                    want_grad[home] += grad_out[slot // k, local + slot % k]
            for rank in range(world):
                _, _, _, extended, grads = results[rank][case]
                assert torch.equal(extended[w][:local], full[rank * local:(rank + 1) * local])
                for s in range(k):
                    home = int(homes[rank * k + s])
                    want = full[home] if home >= 0 else torch.zeros_like(full[0])
                    assert torch.equal(extended[w][local + s], want), f"world={world} case={case} rank={rank} slot={s}"
                torch.testing.assert_close(grads[w], want_grad[rank * local:(rank + 1) * local], atol=1e-6, rtol=1e-6)


def test_echo_options_are_checked():
    with pytest.raises(ValueError, match="num_spare_experts_per_ep_rank > 0 .* needs dropless routing: set capacity"):
        MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, num_spare_experts_per_ep_rank=1,
                  capacity_factor=1.0)
    with pytest.raises(ValueError, match="num_spare_experts_per_ep_rank must be >= 0"):
        MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, num_spare_experts_per_ep_rank=-1)
    with pytest.raises(ValueError, match="echo_tolerance must be >= 0"):
        MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, num_spare_experts_per_ep_rank=1,
                  echo_tolerance=-0.5)
    with pytest.raises(ValueError, match="spare_homes must have"):
        weights_with_spare_slots([torch.zeros(4, 2)], torch.zeros(3, dtype=torch.long), None, 2)


def test_echo_is_off_on_a_single_expert_rank():
    layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, num_spare_experts_per_ep_rank=2))
    assert layer.num_spare == 0 and layer.dispatcher.num_experts == E
    x = torch.randn(S, B, H)
    assert layer(x).shape == x.shape
