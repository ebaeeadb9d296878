"""Tests for the ECHO expert-offloading planner (seed 004).

Unit tests replay every worked example of seed 004 (checked by hand first; one has
an arithmetic slip, tested at its correct value). Property tests simulate all EP
ranks of a group in one process over many random configurations. The last test
runs a tiny MoE layer token by token and shows offloading changes nothing:
outputs and gradients match the layer without offloading.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_megatron.moe import (
    apply_offloading_plan,
    breadth_first_allocation,
    depth_first_allocation,
    gen_assignment,
    gen_intermediate,
    gen_offloading_plan,
    home_expert_of_column,
    home_expert_of_spare,
    interleave_spare_slots,
    one_shot_greedy_assignment,
)
from lightning_megatron.moe.echo import _match_spillover_to_spare_slots, _spillover_in_order

T_ = torch.tensor


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: one intra-op thread is fastest and immune to a busy CI box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spread_over_source_ranks(load_per_expert: list[int], num_ep_ranks: int) -> torch.Tensor:
    """A ``[R, E]`` count matrix whose column sums are ``load_per_expert`` (uneven split on purpose)."""
    load = T_(load_per_expert)
    rows = [load // (num_ep_ranks + 1) for _ in range(num_ep_ranks - 1)]
    return torch.stack([load - sum(rows, torch.zeros_like(load))] + rows)


# ============================================================== seed 004 worked examples


def test_seed_ep_rank_bars_spare_and_spillover():
    # EP loads 500/200/300/400, avg 350: EP1 has 150 spare, EP2 50; EP0 spills 150, EP3 50.
    loads = [300, 200, 120, 80, 150, 150, 100, 300]  # 2 experts per EP rank
    spill, spare, avg = gen_intermediate(spread_over_source_ranks(loads, 4))
    assert avg.item() == 350
    assert spare.tolist() == [0, 150, 50, 0]
    assert spill.view(4, 2).sum(1).tolist() == [150, 0, 0, 50]
    # The heavier expert of a rank spills: EP0 sorted [200, 300] -> cumsum [200, 500] -> [0, 150].
    assert spill.tolist() == [150, 0, 0, 0, 0, 0, 0, 50]


def test_seed_spillover_cumsum_clamp_diff():
    # One EP rank with experts [50, 100, 150, 200] and a group-wide avg of 250.
    # (The seed says "token数总和为1000": this rank holds 500; 1000 is the 4-rank total that
    # makes avg = 250, which is how the group is built here.)
    sorted_counts = T_([50, 100, 150, 200])
    assert sorted_counts.cumsum(0).tolist() == [50, 150, 300, 500]
    assert _spillover_in_order(sorted_counts, T_(250)).tolist() == [0, 0, 50, 200]
    # Unsorted order [200, 50, 150, 100] would spill [0, 0, 150, 100] (seed's counter-example).
    assert _spillover_in_order(T_([200, 50, 150, 100]), T_(250)).tolist() == [0, 0, 150, 100]
    # Naive per-expert subtraction of 250/4 = 62.5 overshoots: 262.5 > the needed 250.
    assert (T_([50.0, 100, 150, 200]) - 62.5).clamp(min=0).sum().item() == 262.5

    loads = [200, 50, 150, 100, 100, 100, 0, 0, 50, 50, 50, 50, 25, 25, 25, 25]  # total 1000
    spill, spare, avg = gen_intermediate(spread_over_source_ranks(loads, 4))
    assert avg.item() == 250
    assert spare.tolist() == [0, 50, 50, 150]
    # gen_intermediate sorts first: [0, 0, 50, 200] lands back on experts (50, 100, 150, 200).
    assert spill[:4].tolist() == [200, 0, 50, 0]
    assert spill[4:].tolist() == [0] * 12


def test_seed_one_shot_greedy_two_chunks():
    # chunks [100, 150] -> [0,100), [100,250); buckets [80, 120] -> [0,80), [80,200).
    # SEED SLIP: the seed prints [[80, 0], [0, 100]], writing chunk0 x bucket1 as
    # "[80,100) ∩ [100,250) = 0". The operands are chunk0 = [0,100) and bucket1 = [80,200),
    # which overlap on [80,100) = 20 tokens. Its own matrix sums to 180 even though
    # min(250, 200) = 200 tokens fit; the 20 tokens of chunk 0 that do not fit bucket 0 go to bucket 1.
    assignment = one_shot_greedy_assignment(T_([100, 150]), T_([80, 120]))
    assert assignment.tolist() == [[80, 20], [0, 100]]


def test_seed_one_shot_greedy_sorted_example():
    spill = T_([0, 80, 0, 0, 50, 100, 0, 30])
    spare = T_([0, 120, 60, 0])
    spill_sorted, spill_idx = spill.sort(descending=True, stable=True)
    spare_sorted, spare_idx = spare.sort(descending=True, stable=True)
    assert spill_sorted.tolist() == [100, 80, 50, 30, 0, 0, 0, 0]
    assert spill_idx.tolist() == [5, 1, 4, 7, 0, 2, 3, 6]
    assert spare_sorted.tolist() == [120, 60, 0, 0]
    assert spare_idx.tolist() == [1, 2, 0, 3]
    assert spill_sorted.cumsum(0).tolist() == [100, 180, 230, 260, 260, 260, 260, 260]
    assert spare_sorted.cumsum(0).tolist() == [120, 180, 180, 180]
    expected = [[100, 0, 0, 0], [20, 60, 0, 0]] + [[0, 0, 0, 0]] * 6
    assert one_shot_greedy_assignment(spill_sorted, spare_sorted).tolist() == expected


def test_seed_top_k_spare_slots_per_ep_rank():
    spill = T_([0, 80, 0, 0, 50, 100, 0, 30])
    spare = T_([0, 120, 60, 0])
    # k = 1: EP1's slot takes expert 5 (100); EP2's slot takes expert 1 (60); expert 1's
    # 20 tokens on EP1 stay home (no second slot there).
    one = _match_spillover_to_spare_slots(spill, spare, 1)
    assert one.shape == (8, 4)
    assert {(e, j, v) for (e, j), v in _nonzero(one)} == {(5, 1, 100), (1, 2, 60)}
    # k = 2: "EP1 的 2 个 spare experts" take the top-2 pieces of its column: (5, 100), (1, 20).
    two = _match_spillover_to_spare_slots(spill, spare, 2)
    assert two.shape == (8, 8)
    assert {(e, j, v) for (e, j), v in _nonzero(two)} == {(5, 2, 100), (1, 3, 20), (1, 4, 60)}
    assert home_expert_of_spare(two).tolist() == [-1, -1, 5, 1, 1, -1, -1, -1]


def _nonzero(x: torch.Tensor):
    return [((i, j), int(x[i, j])) for i, j in itertools.product(*map(range, x.shape)) if x[i, j] != 0]


@pytest.mark.parametrize("capacity, floors, second, total", [
    (80, [24, 40, 16], [0, 0, 0], [24, 40, 16]),
    (83, [24, 41, 16], [2, 0, 0], [26, 41, 16]),  # 24.9 / 41.5 / 16.6 -> floors 81, 2 left
])
def test_seed_breadth_then_depth_first(capacity, floors, second, total):
    # Expert A (expert 0, home EP0) receives 30 / 50 / 20 tokens from EP0 / EP1 / EP2;
    # the plan sends `capacity` of them to spare slot X (slot 2, on EP2).
    counts = T_([[30, 7, 1], [50, 3, 2], [20, 4, 9]])
    assignment = torch.zeros(3, 3, dtype=torch.long)
    assignment[0, 2] = capacity
    first, after_first, leftover = breadth_first_allocation(counts, assignment)
    assert first[:, 2].tolist() == floors
    assert first[:, :2].eq(0).all()
    assert after_first[:, 0].tolist() == [c - f for c, f in zip([30, 50, 20], floors)]
    assert after_first[:, 1:].equal(counts[:, 1:])
    assert leftover[0, 2].item() == capacity - sum(floors)
    second_pass, after_second = depth_first_allocation(after_first, leftover)
    assert second_pass[:, 2].tolist() == second  # EP0 first: it still holds 6 >= 2
    assert (first + second_pass)[:, 2].tolist() == total
    assert sum(total) == capacity
    assert after_second[:, 0].tolist() == [30 - total[0], 50 - total[1], 20 - total[2]]


def test_apply_offloading_plan_hand_example():
    # Expert 0 is routed tokens 0, 2, 3, 5; slots 0 and 1 both copy expert 0 and
    # take 2 and 1 of them: slot 0 -> tokens 0, 2; slot 1 -> token 3; token 5 stays home.
    routing = T_([[1, 0], [0, 1], [1, 1], [1, 0], [0, 1], [1, 1]]).bool()
    probs = torch.arange(1, 13, dtype=torch.float32).view(6, 2) * routing
    home_map = T_([[1, 1], [0, 0]]).bool()
    new_map, new_probs = apply_offloading_plan(routing, probs, T_([2, 1]), home_map)
    assert new_map.long().tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0], [1, 1, 0, 0]]
    assert new_probs[:, 2].tolist() == [1.0, 0, 5, 0, 0, 0]
    assert new_probs[:, 3].tolist() == [0.0, 0, 0, 7, 0, 0]
    assert new_probs[:, 0].tolist() == [0.0, 0, 0, 0, 0, 11]
    assert new_probs[:, 1].equal(probs[:, 1])


def test_interleave_and_column_homes():
    # E = 4, R = 2, k = 1: home|spare columns [h0 h1 h2 h3 s0 s1] -> [h0 h1 s0 h2 h3 s1].
    assert interleave_spare_slots(torch.arange(6), 2, 1).tolist() == [0, 1, 4, 2, 3, 5]
    home_map = torch.zeros(4, 2, dtype=torch.bool)
    home_map[3, 0] = True  # expert 3 (EP1) copied into EP0's slot; EP1's slot unused
    assert home_expert_of_column(home_map, 2).tolist() == [0, 1, 3, 2, 3, -1]


# ============================================================== simulated EP group


def random_group(gen: torch.Generator, num_ep_ranks: int, num_experts: int, num_tokens: int, topk: int, skew: float):
    """Per-rank top-k routing maps [R, T, E] and probs, with a skewed router to create imbalance."""
    bias = torch.randn(num_experts, generator=gen) * skew
    logits = torch.randn(num_ep_ranks, num_tokens, num_experts, generator=gen) + bias
    values, indices = logits.topk(topk, dim=-1)
    routing = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, indices, True)
    probs = torch.zeros_like(logits).scatter_(-1, indices, values.softmax(-1))
    return routing, probs


def plan_group(routing, probs, k):
    num_ep_ranks = routing.shape[0]
    counts = routing.sum(dim=1)  # what the all-gather of routing_map.sum(0) produces: [R, E]
    plans = [gen_offloading_plan(routing[r], probs[r], counts, r, num_ep_ranks, k) for r in range(num_ep_ranks)]
    return counts, plans


def collapse_to_home(x: torch.Tensor, column_home: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sum rank-major columns back onto the home expert whose weights they use."""
    assert not x[..., column_home < 0].any(), "an unused spare slot received tokens"
    out = torch.zeros(*x.shape[:-1], num_experts, dtype=x.dtype)
    return out.index_add_(-1, column_home.clamp(min=0), x)


def configurations(count: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        pick = lambda options: options[torch.randint(len(options), (1,), generator=gen).item()]  # noqa: E731
        num_ep_ranks = pick([1, 2, 3, 4, 8])
        num_experts = num_ep_ranks * pick([1, 2, 3, 4])
        k = pick([1, 2, 3, num_experts])
        topk = min(num_experts, pick([1, 2, 4]))
        routing, probs = random_group(gen, num_ep_ranks, num_experts, pick([1, 5, 16, 33]), topk, pick([0.0, 1.0, 3.0]))
        yield num_ep_ranks, num_experts, k, routing, probs


def test_plan_properties_over_random_configurations():
    for num_ep_ranks, num_experts, k, routing, probs in configurations(200):
        R, E, S = num_ep_ranks, num_experts, num_ep_ranks * k
        counts, plans = plan_group(routing, probs, k)
        assignment, spill, spare = gen_assignment(counts, 0, R, k)
        expert_map = plans[0][2]

        # Static shapes, and every rank holds the same home -> spare map.
        for new_map, new_probs, offload_map in plans:
            assert new_map.shape == new_probs.shape == (routing.shape[1], E + S)
            assert new_map.dtype == torch.bool and new_probs.dtype == probs.dtype
            assert offload_map.shape == (E, S) and offload_map.equal(expert_map)
        assert expert_map.equal(assignment > 0)
        assert (expert_map.sum(dim=0) <= 1).all(), "a spare slot holds one expert"
        column_home = home_expert_of_column(expert_map, R)
        column_rank = torch.arange(E + S) // (E // R + k)
        home_rank = torch.arange(E) // (E // R)
        slot_rank = torch.arange(S) // k
        assert not (expert_map & (home_rank[:, None] == slot_rank[None, :])).any(), "slot on its own home rank"

        # Every (token, expert) pair lands in exactly one column, with its probability.
        new_maps = torch.stack([p[0] for p in plans])
        new_probs = torch.stack([p[1] for p in plans])
        assert collapse_to_home(new_maps.long(), column_home, E).equal(routing.long())
        assert collapse_to_home(new_probs, column_home, E).equal(probs)

        # Spare slots receive exactly the planned tokens; no EP rank over its spare capacity.
        slot_load = interleave_spare_slots(torch.cat([torch.zeros(E, dtype=torch.long), torch.arange(1, S + 1)]), R, k)
        is_slot = slot_load > 0
        received = new_maps.long().sum(dim=(0, 1))  # global tokens per rank-major column
        assert received[is_slot].equal(assignment.sum(dim=0)[slot_load[is_slot] - 1])
        assert (assignment.sum(dim=0).view(R, k).sum(dim=1) <= spare).all()
        assert (assignment.sum(dim=1) <= spill).all()

        # EP-rank loads: overloaded ranks never grow, underloaded ranks never exceed avg.
        total = counts.sum()
        avg = total // R
        before = counts.sum(dim=0).view(R, -1).sum(dim=1)
        after = torch.zeros(R, dtype=torch.long).index_add_(0, column_rank, received)
        assert after.sum() == total
        assert (after[before > avg] <= before[before > avg]).all()
        assert (after[before > avg] >= avg).all()
        assert (after[before <= avg] <= avg).all()

        # Enough spare slots (no greedy piece dropped): receivers are filled to avg, senders
        # keep at most the remainder total % R; with no remainder every expert sheds all of
        # its spillover and every rank lands exactly on avg.
        greedy_pieces = _greedy_pieces_per_rank(spill, spare)
        if (greedy_pieces <= k).all():
            assert (after[before <= avg] == avg).all()
            assert (after <= avg + total % R).all()
            if total % R == 0:
                home_after = counts.sum(dim=0) - assignment.sum(dim=1)
                assert home_after.equal(counts.sum(dim=0) - spill)
                assert (home_after.view(R, -1).sum(dim=1) <= avg).all()
                assert (after == avg).all()


def _greedy_pieces_per_rank(spill: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """How many experts' pieces the unrestricted greedy puts on each EP rank (k needed)."""
    spill_sorted, _ = spill.sort(descending=True, stable=True)
    spare_sorted, _ = spare.sort(descending=True, stable=True)
    return (one_shot_greedy_assignment(spill_sorted, spare_sorted) > 0).sum(dim=0)


def test_enough_spare_slots_balances_exactly():
    """k = E never drops a piece; with total % R == 0 every EP rank ends exactly at avg."""
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for R, per_rank, T in itertools.product([2, 4, 8], [1, 2, 4], [8, 24]):
        E = R * per_rank
        routing, probs = random_group(gen, R, E, T, min(2, E), 3.0)  # R * T * topk is divisible by R
        counts, plans = plan_group(routing, probs, E)
        received = torch.stack([p[0] for p in plans]).long().sum(dim=(0, 1))
        after = torch.zeros(R, dtype=torch.long).index_add_(0, torch.arange(E + R * E) // (per_rank + E), received)
        assert (after == counts.sum() // R).all(), (R, E, T, after)
        checked += 1
    assert checked == 18


def test_allocation_realizes_assignment_for_large_counts():
    """breadth + depth send exactly the planned tokens, never more than a source holds."""
    gen = torch.Generator().manual_seed(2)
    for R, per_rank, k in itertools.product([1, 2, 4, 8, 16], [1, 2, 8], [1, 2, 4]):
        E = R * per_rank
        counts = torch.randint(0, 10**6, (R, E), generator=gen) * (torch.rand(R, E, generator=gen) < 0.8)
        counts[:, 0] *= 7  # one hot expert
        assignment, _, _ = gen_assignment(counts, 0, R, k)
        first, after_first, leftover = breadth_first_allocation(counts, assignment)
        assert (leftover >= 0).all() and (first >= 0).all()
        second, after = depth_first_allocation(after_first, leftover)
        sent = first + second
        assert sent.sum(dim=0).equal(assignment.sum(dim=0))
        assert (after >= 0).all()
        assert after.equal(counts - _sent_per_home_expert(sent, assignment))


def _sent_per_home_expert(sent: torch.Tensor, assignment: torch.Tensor) -> torch.Tensor:
    home = home_expert_of_spare(assignment)
    out = torch.zeros(sent.shape[0], assignment.shape[0], dtype=torch.long)
    return out.index_add_(1, home.clamp(min=0), sent * (home >= 0))


def test_plan_is_a_deterministic_function_of_the_global_counts():
    for R, E, k, routing, probs in configurations(40, seed=3):
        counts = routing.sum(dim=1)
        for r in range(R):
            first = gen_offloading_plan(routing[r], probs[r], counts, r, R, k)
            again = gen_offloading_plan(routing[r].clone(), probs[r].clone(), counts.clone().int(), torch.tensor(r), R, k)
            for a, b in zip(first, again):
                assert a.equal(b)
            # The home -> spare map reads only the global counts, not this rank's tokens.
            other = gen_offloading_plan(routing[(r + 1) % R], probs[(r + 1) % R], counts, r, R, k)
            assert other[2].equal(first[2])


def test_shapes_are_static_and_need_no_data():
    """Same shapes for any data; the planner runs on the meta device (no data-dependent op)."""
    for R, per_rank, k, T in itertools.product([1, 2, 4], [1, 3], [1, 2], [1, 7]):
        E = R * per_rank
        shapes = set()
        for seed in range(5):
            gen = torch.Generator().manual_seed(seed)
            routing, probs = random_group(gen, R, E, T, 1, 3.0 * seed)
            _, plans = plan_group(routing, probs, k)
            shapes.add(tuple(tuple(t.shape) for t in plans[-1]))
        meta = gen_offloading_plan(
            torch.empty(T, E, dtype=torch.bool, device="meta"),
            torch.empty(T, E, device="meta"),
            torch.empty(R, E, dtype=torch.long, device="meta"),
            torch.tensor(0, device="meta"),
            R,
            k,
        )
        shapes.add(tuple(tuple(t.shape) for t in meta))
        assert shapes == {((T, E + R * k), (T, E + R * k), (E, R * k))}


def test_balanced_or_empty_load_offloads_nothing():
    R, E, T = 4, 8, 16
    routing = torch.zeros(R, T, E, dtype=torch.bool)
    routing[:, torch.arange(T), torch.arange(T) % E] = True  # every expert gets the same load
    for routing_case in (routing, torch.zeros_like(routing)):
        probs = routing.float()
        _, plans = plan_group(routing_case, probs, 2)
        for r, (new_map, _, offload_map) in enumerate(plans):
            assert not offload_map.any()
            assert collapse_to_home(new_map.long(), home_expert_of_column(offload_map, R), E).equal(routing_case[r].long())


@pytest.mark.parametrize("tolerance", [0.0, 0.1, 0.25, 0.5])
def test_tolerance_spills_only_the_load_above_it(tolerance):
    """Each EP rank spills exactly its load above ``avg + avg·tolerance`` (whole per-mille); tolerance 0 is the
    seed's planner; within the tolerance everywhere, no spare slot is used (so no expert weights move)."""
    gen = torch.Generator().manual_seed(3)
    for R, E in ((2, 4), (4, 8), (4, 16)):
        for _ in range(20):
            counts = torch.randint(0, 40, (R, E), generator=gen)
            counts[0, : E // R] += torch.randint(0, 60, (E // R,), generator=gen)   # skew towards rank 0
            spill, spare, avg = gen_intermediate(counts, tolerance=tolerance)
            load = counts.sum(dim=0).view(R, -1).sum(dim=1)
            limit = avg + avg * round(tolerance * 1000) // 1000
            assert spill.view(R, -1).sum(dim=1).equal(torch.relu(load - limit))
            assert spare.equal(torch.relu(avg - load))
            if tolerance == 0.0:
                assert spill.equal(gen_intermediate(counts)[0])
            assignment, _, _ = gen_assignment(counts, num_spare_experts_per_ep_rank=2, tolerance=tolerance)
            used = home_expert_of_spare(assignment) >= 0
            assert bool(used.any()) == bool((load > limit).any() and (load < avg).any())


def test_tolerance_is_checked():
    with pytest.raises(ValueError, match="tolerance must be a fraction >= 0"):
        gen_intermediate(torch.ones(2, 4, dtype=torch.long), tolerance=-0.1)


# ============================================================== offloading == no offloading


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w1) @ w2


def moe_token_loop(x, probs, routing, w1s, w2s):
    """Reference MoE, one token and one routed column at a time: y[t] = sum_c p[t,c] f_c(x[t])."""
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for c in range(routing.shape[1]):
            if routing[t, c]:
                y = y + probs[t, c] * expert_mlp(x[t], w1s[c], w2s[c])
        rows.append(y)
    return torch.stack(rows)


def router(x, w_router, topk):
    logits = x @ w_router
    values, indices = logits.topk(topk, dim=-1)
    routing = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, indices, True)
    probs = torch.zeros_like(logits).scatter(-1, indices, values.softmax(-1))
    return routing, probs


def test_offloaded_moe_matches_unoffloaded_outputs_and_gradients():
    gen = torch.Generator().manual_seed(4)
    R, per_rank, k, T, H, F, topk = 4, 2, 2, 10, 6, 8, 2
    E = R * per_rank
    x = torch.randn(R, T, H, generator=gen)
    w_router = torch.randn(H, E, generator=gen)
    w_router[:, 0] += 2.0  # expert 0 (EP0) and expert 1 get most tokens
    w_router[:, 1] += 1.0
    w1 = torch.randn(E, H, F, generator=gen) / H**0.5
    w2 = torch.randn(E, F, H, generator=gen) / F**0.5
    grad_out = torch.randn(R, T, H, generator=gen)

    def leaves():
        return [t.clone().requires_grad_() for t in (x, w_router, w1, w2)]

    # Without offloading.
    xr, wr, a1, a2 = leaves()
    outputs = []
    for r in range(R):
        routing, probs = router(xr[r], wr, topk)
        outputs.append(moe_token_loop(xr[r], probs, routing, a1, a2))
    reference = torch.stack(outputs)
    (reference * grad_out).sum().backward()

    # With offloading: the plan from all-gathered counts, spare slots hold copies of
    # their home expert's weights (what the expert dispatcher would send them).
    xo, wo, b1, b2 = leaves()
    routed = [router(xo[r], wo, topk) for r in range(R)]
    counts = torch.stack([routing.sum(dim=0) for routing, _ in routed])
    plans = [gen_offloading_plan(routing, probs, counts, r, R, k) for r, (routing, probs) in enumerate(routed)]
    offload_map = plans[0][2]
    assert offload_map.any(), "the test must actually offload something"
    homes = home_expert_of_spare(offload_map)
    spare_w1 = [b1[h].detach().clone().requires_grad_() for h in homes.clamp(min=0)]
    spare_w2 = [b2[h].detach().clone().requires_grad_() for h in homes.clamp(min=0)]
    w1_columns = interleave_spare_slots(torch.arange(E + R * k), R, k)  # home|spare index per column
    w1s = [b1[i] if i < E else spare_w1[i - E] for i in w1_columns.tolist()]
    w2s = [b2[i] if i < E else spare_w2[i - E] for i in w1_columns.tolist()]
    offloaded = torch.stack([moe_token_loop(xo[r], plans[r][1], plans[r][0], w1s, w2s) for r in range(R)])
    assert sum(int(p[0][:, is_spare].sum()) for p in plans for is_spare in [w1_columns >= E]) > 0
    (offloaded * grad_out).sum().backward()

    torch.testing.assert_close(offloaded, reference)
    torch.testing.assert_close(xo.grad, xr.grad)
    torch.testing.assert_close(wo.grad, wr.grad)
    # Weight gradients of each spare copy are summed back into its home expert.
    g1, g2 = b1.grad.clone(), b2.grad.clone()
    for j, h in enumerate(homes.tolist()):
        if h >= 0:
            g1[h] += spare_w1[j].grad
            g2[h] += spare_w2[j].grad
    torch.testing.assert_close(g1, a1.grad)
    torch.testing.assert_close(g2, a2.grad)


# ============================================================== CUDA graph (GPU machine only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_captures_in_a_cuda_graph_without_host_sync():
    R, E, k, T = 4, 16, 2, 64
    gen = torch.Generator().manual_seed(5)
    cases = [random_group(gen, R, E, T, 2, 3.0) for _ in range(3)]
    dev = torch.device("cuda")
    static_map = torch.zeros(T, E, dtype=torch.bool, device=dev)
    static_probs = torch.zeros(T, E, device=dev)
    static_counts = torch.zeros(R, E, dtype=torch.long, device=dev)
    static_rank = torch.zeros((), dtype=torch.long, device=dev)

    def load(routing, probs, r):
        static_map.copy_(routing[r])
        static_probs.copy_(probs[r])
        static_counts.copy_(routing.sum(dim=1))
        static_rank.fill_(r)

    def plan():
        return gen_offloading_plan(static_map, static_probs, static_counts, static_rank, R, k)

    load(*cases[0], 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan()  # warm-up on a side stream, as torch.cuda.graph requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outputs = plan()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    for routing, probs in cases:
        counts = routing.sum(dim=1)
        for r in range(R):
            load(routing, probs, r)
            graph.replay()
            expected = gen_offloading_plan(routing[r], probs[r], counts, r, R, k)
            for got, want in zip(outputs, expected):
                assert got.cpu().equal(want)
