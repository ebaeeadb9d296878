"""Router: scores and top-k against hand-computed examples, balancing losses against their
formulas, the aux-loss-free bias update, token dropping and pad-to-capacity."""

import math

import pytest
import torch

from lightning_megatron.moe import (
    TopKRouter, apply_capacity, expert_capacity, set_aux_loss_scale, topk_routing, update_expert_biases,
)

sig = lambda v: 1.0 / (1.0 + math.exp(-v))


def selected(routing_map):
    return [sorted(torch.nonzero(row).flatten().tolist()) for row in routing_map]


# --- scores and top-k ------------------------------------------------------------------------------


def test_softmax_after_topk_mixtral():
    probs, routing_map = topk_routing(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), topk=2)
    e = math.e
    assert selected(routing_map) == [[1, 2]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, e / (e + 1), 1 / (e + 1), 0.0]]))


def test_softmax_before_topk():
    probs, routing_map = topk_routing(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), topk=2, pre_softmax=True)
    total = math.exp(1) + math.exp(3) + math.exp(2) + 1
    assert selected(routing_map) == [[1, 2]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, math.exp(3) / total, math.exp(2) / total, 0.0]]))


def test_sigmoid_normalized_and_scaled():
    probs, routing_map = topk_routing(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), topk=2, score_function="sigmoid",
                                      scaling_factor=2.5)
    a, b = sig(3), sig(2)
    assert selected(routing_map) == [[1, 2]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 2.5 * a / (a + b), 2.5 * b / (a + b), 0.0]]))


def test_expert_bias_moves_the_choice_not_the_probability():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    probs, routing_map = topk_routing(logits, topk=1, score_function="sigmoid",
                                      expert_bias=torch.tensor([10.0, 0.0, 0.0, 0.0]))
    assert selected(routing_map) == [[0]]
    torch.testing.assert_close(probs, torch.tensor([[sig(1.0), 0.0, 0.0, 0.0]]))


def test_group_limited_topk():
    # 4 groups of 2 experts; a group scores the sum of its best topk // group_topk = 2 sigmoids:
    # g0 = σ5+σ0 = 1.49, g1 = σ4+σ4.5 = 1.97, g2 = 2σ1 = 1.46, g3 = σ4.8+σ(-3) = 1.04 -> g1, g0.
    logits = torch.tensor([[5.0, 0.0, 4.0, 4.5, 1.0, 1.0, 4.8, -3.0]])
    _, plain = topk_routing(logits, topk=4, score_function="sigmoid")
    probs, limited = topk_routing(logits, topk=4, score_function="sigmoid", num_groups=4, group_topk=2)
    assert selected(plain) == [[0, 2, 3, 6]]
    assert selected(limited) == [[0, 1, 2, 3]]
    s = [sig(v) for v in (5.0, 0.0, 4.0, 4.5)]
    torch.testing.assert_close(probs[0, :4], torch.tensor(s) / sum(s))
    assert probs[0, 4:].abs().sum() == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_groups=3, group_topk=1), "divisible by num_groups"),
    (dict(num_groups=4, group_topk=3), "divisible by group_topk"),
    (dict(num_groups=4), "both num_groups and group_topk"),
    (dict(pad_to_capacity=True), "capacity_factor"),
    (dict(score_function="relu"), "score_function"),
])
def test_router_errors_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TopKRouter(8, 8, 2, **kwargs)


# --- balancing losses ------------------------------------------------------------------------------


def _router(**kwargs):
    torch.manual_seed(0)
    return TopKRouter(8, 4, 2, **kwargs)


def test_balancing_losses_match_their_formulas():
    router = _router(aux_loss_coeff=0.3, seq_aux_loss_coeff=0.2, z_loss_coeff=0.05)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1))      # [S, B, H]
    _, routing_map = router(x)
    logits = x.reshape(12, 8) @ router.weight.detach().t()
    scores = torch.softmax(logits, -1)
    counts = routing_map.float()
    switch = 0.3 * 4 / 2 * sum((counts[:, e].sum() / 12) * scores[:, e].mean() for e in range(4))
    seq = 0.0
    for b in range(2):
        rows = [s * 2 + b for s in range(6)]
        seq += sum(counts[rows, e].sum() * 4 / (2 * 6) * scores[rows, e].mean() for e in range(4))
    zl = 0.05 * torch.logsumexp(logits, -1).square().mean()
    got = router.aux_losses
    torch.testing.assert_close(got["load_balancing_loss"], switch)
    torch.testing.assert_close(got["seq_load_balancing_loss"], 0.2 * seq / 2)
    torch.testing.assert_close(got["z_loss"], zl)


def test_uniform_routing_gives_the_coefficient():
    # Every expert gets exactly T·k/E tokens and mean score 1/E: the switch loss equals its coefficient.
    scores = torch.full((8, 4), 0.25)
    routing_map = torch.zeros(8, 4, dtype=torch.bool)
    for t in range(8):
        routing_map[t, [t % 4, (t + 1) % 4]] = True
    from lightning_megatron.moe import switch_load_balancing_loss
    torch.testing.assert_close(switch_load_balancing_loss(scores, routing_map, 2, 0.01), torch.tensor(0.01))


def test_aux_loss_gradient_reaches_the_router_and_follows_the_scale():
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(2))
    router = _router(aux_loss_coeff=0.5, z_loss_coeff=0.1)
    probs, _ = router(x)
    (probs * 0).sum().backward()                      # the main loss ignores the router...
    injected = router.weight.grad.clone()
    direct = router.weight.detach().clone().requires_grad_()
    logits = x @ direct.t()
    scores = torch.softmax(logits, -1)
    _, idx = logits.topk(2, dim=-1)
    counts = torch.zeros(4).index_add_(0, idx.flatten(), torch.ones(24))
    loss = 0.5 * 4 / (2 * 12 * 12) * (scores.sum(0) * counts).sum() \
        + 0.1 * torch.logsumexp(logits, -1).square().mean()
    loss.backward()
    torch.testing.assert_close(injected, direct.grad)  # ...yet the aux gradient arrives

    router.weight.grad = None
    set_aux_loss_scale(router, 0.25)                   # e.g. 1 / num_microbatches
    probs, _ = router(x)
    (probs * 0).sum().backward()
    torch.testing.assert_close(router.weight.grad, 0.25 * direct.grad)


def test_aux_loss_free_bias_update():
    router = _router(score_function="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.1)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    _, routing_map = router(x)
    torch.testing.assert_close(router.local_tokens_per_expert, routing_map.sum(0).float())
    router.eval()
    router(x)                                          # evaluation does not count
    torch.testing.assert_close(router.local_tokens_per_expert, routing_map.sum(0).float())
    router.local_tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))   # mean 3
    update_expert_biases(router)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert router.local_tokens_per_expert.abs().sum() == 0
    assert "expert_bias" in router.state_dict()        # checkpointed with the model


# --- capacity ---------------------------------------------------------------------------------------

# Tokens 0, 1, 2 go to expert 0 (probs .6, .9, .7), token 3 to expert 1 (.8); capacity 2.
PROBS = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.0, 0.8]])
MAP = PROBS > 0


def test_capacity_formula():
    assert expert_capacity(4, 2, 1, 1.0) == 2
    assert expert_capacity(16, 8, 2, 1.0) == 4
    assert expert_capacity(16, 8, 2, 1.1) == 5
    assert expert_capacity(4, 2, 2, 10.0) == 4     # never more than the tokens there are


def test_drop_by_probability_keeps_the_most_confident():
    probs, routing_map = apply_capacity(PROBS, MAP, 2, "probs")
    assert selected(routing_map.t()) == [[1, 2], [3]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0], [0.9, 0.0], [0.7, 0.0], [0.0, 0.8]]))


def test_drop_by_position_keeps_the_earliest():
    probs, routing_map = apply_capacity(PROBS, MAP, 2, "position")
    assert selected(routing_map.t()) == [[0, 1], [3]]
    torch.testing.assert_close(probs, torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.0, 0.0], [0.0, 0.8]]))


def test_pad_to_capacity_fills_every_expert_with_zero_probability_tokens():
    probs, routing_map = apply_capacity(PROBS, MAP, 2, "probs", pad_to_capacity=True)
    assert selected(routing_map.t()) == [[1, 2], [0, 3]]       # token 0 pads expert 1 ...
    assert probs[0, 1] == 0                                     # ... and contributes nothing


def test_router_pad_to_capacity_has_static_shapes():
    router = _router(capacity_factor=1.0, pad_to_capacity=True)
    capacity = router.capacity(12)
    for seed in range(4):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        probs, routing_map = router(x)
        assert routing_map.sum(0).tolist() == [capacity] * 4
        assert probs.shape == (12, 4)
    dropping = _router(capacity_factor=1.0)
    _, routing_map = dropping(torch.randn(12, 8, generator=torch.Generator().manual_seed(5)) * 4)
    assert (routing_map.sum(0) <= capacity).all()
