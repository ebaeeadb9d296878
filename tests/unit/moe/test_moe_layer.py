"""An MoE layer on gloo ranks equals a plain per-token loop over experts on one process.

Every layout (EP=1/2/4, ETP=2, TP with and without sequence parallelism, etp != tp, edp > 1)
runs both dispatchers, dropless, padded to capacity and dropping; outputs, input gradients,
router/expert/shared-expert gradients (gathered to global) and the reported balancing losses
must match the reference, and the gathered initial weights must equal the EP=1 ones.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.moe import MoEConfig, MoELayer, collect_aux_losses
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks
from helpers.moe_utils import global_weights

S, B, H, FFN, E, K = 8, 2, 8, 8, 8, 2     # sequence, batch, hidden, expert ffn, experts, top-k
SEED = 1234

# Six variants per layout: both dispatchers x (dropless, padded, dropping), options rotated.
VARIANTS = [
    dict(dispatcher="alltoall", score_function="softmax", aux_loss_coeff=0.1, z_loss_coeff=0.01,
         shared_expert_ffn_hidden_size=8),
    dict(dispatcher="allgather", score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0,
         enable_expert_bias=True, seq_aux_loss_coeff=0.1),
    dict(dispatcher="alltoall", score_function="softmax", pre_softmax=True, aux_loss_coeff=0.1,
         capacity_factor=1.0, drop_policy="probs", pad_to_capacity=True),
    dict(dispatcher="allgather", score_function="sigmoid", activation="gelu", shared_expert_ffn_hidden_size=8,
         capacity_factor=1.0, drop_policy="position", pad_to_capacity=True),
    dict(dispatcher="alltoall", score_function="softmax", seq_aux_loss_coeff=0.1, capacity_factor=1.0,
         drop_policy="position"),
    dict(dispatcher="allgather", score_function="softmax", pre_softmax=True, z_loss_coeff=0.01,
         shared_expert_ffn_hidden_size=8, capacity_factor=0.75, drop_policy="probs"),
]
EXPERT_BIAS = torch.linspace(-0.05, 0.05, E)


def config(variant, sequence_parallel):
    return MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, topk=K,
                     sequence_parallel=sequence_parallel, **variant)


def data(dp):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(dp, S, B, H, generator=gen), torch.randn(dp, S, B, H, generator=gen)


# --- the ranks' side ---------------------------------------------------------------------------------


def _run_case(state, variant, sequence_parallel):
    cfg = config(variant, sequence_parallel and state.tp_size > 1)
    torch.manual_seed(SEED)
    layer = MoELayer(cfg)
    if cfg.enable_expert_bias:
        layer.router.expert_bias.copy_(EXPERT_BIAS)
    weights = global_weights(layer, state, grads=False)
    xs, gs = data(state.dp_size)
    x, g = xs[state.dp_rank], gs[state.dp_rank]
    if cfg.sequence_parallel:
        x, g = x.chunk(state.tp_size)[state.tp_rank], g.chunk(state.tp_size)[state.tp_rank]
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * g).sum().backward()
    aux = collect_aux_losses(layer, group=state.group("tp-cp"))
    result = {"dp": state.dp_rank, "tp": state.tp_rank, "out": out.detach(), "dx": x.grad,
              "aux": {k: v.item() for k, v in aux.items()}}
    grads = global_weights(layer, state, grads=True)
    if state.rank == 0:
        result.update(weights=weights, grads=grads)
    return result


def _run_layouts(layouts):
    world = dist.get_world_size()
    results = []
    for layout in layouts:
        kwargs = {k: v for k, v in layout.items() if k != "sp"}
        state = ParallelState(ParallelLayout(world, **kwargs)).activate()
        results.append([_run_case(state, v, layout.get("sp", False)) for v in VARIANTS])
        state.destroy()
    return results


# --- the reference: one process, one token at a time -------------------------------------------------


def _act(h, activation):
    if activation == "swiglu":
        gate, up = h.chunk(2)
        return F.silu(gate) * up
    return F.gelu(h)


def _choose(logits, cfg, bias):
    """Indices and differentiable probabilities of one token's experts."""
    if cfg.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, 0) if cfg.pre_softmax else logits
    sel = (scores.detach() + (bias if cfg.enable_expert_bias else 0)).tolist()
    allowed = range(E)
    if cfg.num_groups:
        size = E // cfg.num_groups
        best = lambda grp: sum(sorted(sel[grp * size:(grp + 1) * size], reverse=True)[:K // cfg.group_topk])
        groups = sorted(range(cfg.num_groups), key=lambda grp: -best(grp))[:cfg.group_topk]
        allowed = [e for e in range(E) if e // size in groups]
    chosen = sorted(allowed, key=lambda e: -sel[e])[:K]
    picked = scores[chosen]
    if cfg.score_function == "softmax" and not cfg.pre_softmax:
        picked = torch.softmax(picked, 0)
    elif cfg.score_function == "sigmoid" and K > 1:
        picked = picked / picked.sum()
    return chosen, picked * (cfg.scaling_factor or 1.0)


def _aux(cfg, logits, chosen):
    """The balancing losses (by name) of one dp shard's S*B tokens, straight from their definitions."""
    scores = torch.softmax(logits, -1)
    if cfg.score_function == "sigmoid":
        scores = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    counts = torch.zeros(S * B, E)
    for t, experts in enumerate(chosen):
        counts[t, experts] = 1.0
    losses = {}
    if cfg.aux_loss_coeff:
        f, p = counts.sum(0) / (S * B), scores.mean(0)
        losses["load_balancing_loss"] = cfg.aux_loss_coeff * E / K * (f * p).sum()
    if cfg.seq_aux_loss_coeff:
        seq = 0.0
        for b in range(B):
            rows = [s * B + b for s in range(S)]
            f = counts[rows].sum(0) * E / (K * S)
            seq = seq + (f * scores[rows].mean(0)).sum()
        losses["seq_load_balancing_loss"] = cfg.seq_aux_loss_coeff * seq / B
    if cfg.z_loss_coeff:
        losses["z_loss"] = cfg.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return losses


def reference(cfg, weights, xs, gs, tp):
    """Outputs, loss gradients and balancing losses of the layer computed token by token."""
    leaves = {k: v.clone().requires_grad_() for k, v in weights.items()}
    xs = xs.clone().requires_grad_()
    outs, auxes, loss = [], [], 0.0
    chunk = S // tp * B                                       # tokens each tp rank routes
    for d in range(xs.shape[0]):
        tokens = xs[d].reshape(S * B, H)
        logits = tokens @ leaves["router"].t()
        routes = [_choose(logits[t], cfg, EXPERT_BIAS) for t in range(S * B)]
        kept = [dict(zip(c, p)) for c, p in routes]
        if cfg.capacity_factor:
            cap = max(1, min(math.ceil(chunk * K / E * cfg.capacity_factor), chunk))
            for start in range(0, S * B, chunk):
                for e in range(E):
                    mine = [t for t in range(start, start + chunk) if e in kept[t]]
                    key = (lambda t: (-kept[t][e].item(), t)) if cfg.drop_policy == "probs" else (lambda t: t)
                    for t in sorted(mine, key=key)[cap:]:
                        del kept[t][e]
        rows = []
        for t in range(S * B):
            y = torch.zeros(H)
            for e, p in kept[t].items():
                y = y + p * (leaves["w2"][e] @ _act(leaves["w1"][e] @ tokens[t], cfg.activation))
            if "s1" in leaves:
                y = y + leaves["s2"] @ _act(leaves["s1"] @ tokens[t], cfg.activation)
            rows.append(y)
        out = torch.stack(rows).view(S, B, H)
        aux = _aux(cfg, logits, [c for c, _ in routes])
        loss = loss + (out * gs[d]).sum() + sum(aux.values())
        outs.append(out.detach())
        auxes.append({k: v.item() for k, v in aux.items()})
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items()}
    return torch.stack(outs), xs.grad, grads, auxes


def check_world(world, layouts):
    assert layouts[0] == {}, "the first layout is the EP=1 baseline"
    results = run_on_ranks(_run_layouts, world, layouts, timeout=120)
    baseline, cache = {}, {}
    for li, layout in enumerate(layouts):
        sp = layout.get("sp", False) and layout.get("tp", 1) > 1
        tp = layout.get("tp", 1)
        dp = world // tp
        xs, gs = data(dp)
        for vi, variant in enumerate(VARIANTS):
            name = f"world={world} layout={layout} variant={vi} ({variant['dispatcher']})"
            cfg = config(variant, sp)
            rank0 = results[0][li][vi]
            # The reference depends on the layout only through dp and tp (and the weights, which
            # the init check below proves identical), so layouts share it.
            key = (vi, dp, tp)
            if key not in cache or any(not torch.equal(w, cache[key][0][n]) for n, w in rank0["weights"].items()):
                cache[key] = (rank0["weights"], reference(cfg, rank0["weights"], xs, gs, tp))
            ref_out, ref_dx, ref_grads, ref_aux = cache[key][1]
            for rank in range(world):
                r = results[rank][li][vi]
                want_out, want_dx = ref_out[r["dp"]], ref_dx[r["dp"]]
                if sp:
                    want_out, want_dx = want_out.chunk(tp)[r["tp"]], want_dx.chunk(tp)[r["tp"]]
                torch.testing.assert_close(r["out"], want_out, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name} out: {m}")
                torch.testing.assert_close(r["dx"], want_dx, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name} dx: {m}")
                assert r["aux"] == pytest.approx(ref_aux[r["dp"]], rel=1e-5), f"{name} balancing losses"
            for key, grad in ref_grads.items():
                torch.testing.assert_close(rank0["grads"][key], grad, atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{name} grad {key}: {m}")
            if li == 0:              # layouts[0] is EP=1, TP=1: the reference numbers for init
                baseline[vi] = rank0["weights"]
                continue
            for w, value in rank0["weights"].items():    # shard-consistent init: EP=N holds EP=1's numbers
                torch.testing.assert_close(value, baseline[vi][w], atol=0, rtol=0,
                                           msg=lambda m: f"{name} init {w}: {m}")


def test_moe_layer_single_rank_matches_per_token_loop():
    check_world(1, [{}])


def test_moe_layer_two_ranks_matches_per_token_loop():
    # EP=1 baseline first, then EP=2; ETP=2 inside experts (tp=2, SP); tp=2 replicated with ep=2, etp=1.
    check_world(2, [{}, {"ep": 2}, {"tp": 2, "sp": True}, {"tp": 2, "ep": 2, "etp": 1}])


def test_moe_layer_four_ranks_matches_per_token_loop():
    # EP=4; tp=2 SP with ep=2, etp=2; tp=2 replicated, ep=2, etp=1 (edp=2); tp=1 with etp=2, ep=2.
    check_world(4, [{}, {"ep": 4}, {"tp": 2, "ep": 2, "sp": True}, {"tp": 2, "ep": 2, "etp": 1},
                    {"ep": 2, "etp": 2}])


def _layout_errors():
    messages = []
    for layout, options, shape in [({"ep": 2}, dict(num_experts=3), None),
                                   ({"tp": 2}, dict(ffn_hidden_size=7), None),
                                   ({"tp": 2}, {}, (3, 2, H))]:
        state = ParallelState(ParallelLayout(2, **layout)).activate()
        try:
            layer = MoELayer(MoEConfig(**{**dict(hidden_size=H, ffn_hidden_size=FFN, num_experts=4), **options}))
            layer(torch.randn(shape))
        except ValueError as err:
            messages.append(str(err))
        state.destroy()
    return messages


def test_layout_errors_name_the_parameter_and_the_fix():
    messages = run_on_ranks(_layout_errors, 2, timeout=60)[0]
    assert "num_experts=3 is not divisible by the expert-parallel size (ep) 2" in messages[0]
    assert "ffn_hidden_size=7 is not divisible by the expert tensor-parallel size (etp) 2" in messages[1]
    assert "not divisible by the tensor-parallel size 2" in messages[2] and "sequence_parallel" in messages[2]


def test_expert_weights_do_not_depend_on_the_default_device():
    """Lightning builds models under a default-device context (cuda on GPUs): the experts' master weights
    must still come from the CPU generator, the same on every device and EP rank. A meta default device
    stands in for cuda here: any draw that follows the default device would fail or differ."""
    from lightning_megatron.moe import GroupedMLP
    from lightning_megatron.tensor_parallel.layers import init_method_normal, init_sharded_

    def build():
        torch.manual_seed(3)
        shard = torch.empty(3, 8, device="cpu")
        init_sharded_(shard, (6, 8), 0, init_method_normal(), rank=1, world_size=2)
        return GroupedMLP(4, 8, 6, first_expert=4, device="cpu"), shard

    plain_experts, plain_shard = build()
    with torch.device("meta"):
        experts, shard = build()
    assert torch.equal(experts.weight1, plain_experts.weight1) and torch.equal(experts.weight2, plain_experts.weight2)
    assert torch.equal(shard, plain_shard)
