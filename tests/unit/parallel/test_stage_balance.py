"""Pipeline stages balanced by cost: exact without virtual stages (brute force agrees), never worse than the
even split, the measured 1B Llama case, MoE layers, and what each piece is counted to cost."""

import itertools
import random

import pytest

from lightning_megatron.parallel import ParallelConfigError
from lightning_megatron.parallel.stage_balance import balanced_layout, chunk_costs, stage_costs
from lightning_megatron.parallel.stages import check_layout, chunk_layer_range, split_layout, virtual_stage
from lightning_megatron.models.llama import llama_config
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.transformer.stage_costs import language_model_costs


def compositions(n, k):
    """Every layout of n layers over k chunks."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def slowest(layout, costs, pp, first, last):
    return max(stage_costs(layout, costs, pp, first, last))


def test_equal_layers_and_no_extra_cost_give_the_even_split():
    for pp, vp, n in [(2, 1, 8), (4, 1, 16), (4, 2, 16), (2, 4, 8), (3, 2, 12)]:
        assert balanced_layout([7] * n, pp, vp) == split_layout(n, pp, vp if vp > 1 else None)


def test_exact_without_virtual_stages_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        pp, n = rng.choice([2, 3, 4]), rng.randint(1, 10)
        costs = [rng.choice([1, 2, 3, 5, 8]) for _ in range(n)]
        first, last = rng.choice([0, 1, 4]), rng.choice([0, 3, 9, 20])
        layout = balanced_layout(costs, pp, None, first, last)
        assert sum(layout) == n and len(layout) == pp
        best = min(slowest(c, costs, pp, first, last) for c in compositions(n, pp))
        assert slowest(layout, costs, pp, first, last) == best, (pp, costs, first, last, layout)


def test_virtual_stages_near_the_best_and_never_worse_than_the_even_split():
    rng = random.Random(1)
    exact = tried = 0
    for _ in range(120):
        pp, vp = rng.choice([2, 3, 4]), rng.choice([2, 3])
        if pp * vp > 8:
            continue
        n = rng.randint(pp * vp, 9)
        costs = [rng.choice([1, 2, 3, 5, 8]) for _ in range(n)]
        first, last = rng.choice([0, 1, 4]), rng.choice([0, 3, 9, 20])
        layout = balanced_layout(costs, pp, vp, first, last)
        got = slowest(layout, costs, pp, first, last)
        best = min(slowest(c, costs, pp, first, last) for c in compositions(n, pp * vp))
        assert got <= 1.1 * best, (pp, vp, costs, first, last, layout)
        if n % (pp * vp) == 0:
            assert got <= slowest(split_layout(n, pp, vp), costs, pp, first, last)
        exact, tried = exact + (got == best), tried + 1
    assert exact >= 0.9 * tried


def llama_1b(**overrides):
    return llama_config(16, 2048, 32, num_query_groups=8, ffn_hidden_size=8192, **overrides)


def test_the_1b_llama_output_layer_and_loss_count_as_about_four_layers():
    costs = language_model_costs(llama_1b(), 4096, 128256)
    gemms = 3 * (2 * 2048 * (2 * 2048 + 2 * 512) + 2 * 2048 * 4096 + 6 * 2048 * 8192) * 4096
    elementwise = 200 * 2 * (24 * 2048 + 6 * 8192) * 4096
    assert costs.layers[0] == gemms + elementwise
    assert costs.head == 3 * 2 * 2048 * 128256 * 4096 + 200 * 4 * 2 * 128256 * 4096
    # measured on an H200 with the unfused loss: 4.3 layers; any ratio in [3, 5) gives the same 4-stage split
    assert costs.head / costs.layers[0] == pytest.approx(3.92, abs=0.01)
    assert costs.embedding < 0.01 * costs.layers[0]


def test_tiny_models_are_not_split_as_if_only_the_vocabulary_mattered():
    costs = language_model_costs(TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4), 8, 64)
    assert costs.head < costs.layers[0] and costs.embedding < 0.1 * costs.layers[0]
    assert balanced_layout(costs.layers, 2, None, costs.embedding, costs.head) == (2, 2)


def test_the_1b_llama_on_four_and_two_stages():
    costs = language_model_costs(llama_1b(), 4096, 128256)
    args = (costs.layers, costs.embedding, costs.head)
    assert balanced_layout(args[0], 4, None, *args[1:]) == (5, 5, 5, 1)
    assert balanced_layout(args[0], 2, None, *args[1:]) == (10, 6)
    interleaved = balanced_layout(args[0], 4, 2, *args[1:])
    even = split_layout(16, 4, 2)
    assert slowest(interleaved, *args[:1], 4, *args[1:]) < 0.75 * slowest(even, *args[:1], 4, *args[1:])
    assert slowest(interleaved, *args[:1], 4, *args[1:]) == slowest((5, 5, 5, 1), *args[:1], 4, *args[1:])


def test_recomputed_layers_and_a_recomputed_output_layer_count_their_extra_forward():
    plain = language_model_costs(llama_1b(), 4096, 128256)
    recomputed = language_model_costs(llama_1b(recompute_layers=True), 4096, 128256, recompute_output_layer=True)
    gemms = 2 * 2048 * (2 * 2048 + 2 * 512) + 2 * 2048 * 4096 + 6 * 2048 * 8192
    assert recomputed.layers[0] - plain.layers[0] == gemms * 4096
    assert recomputed.head - plain.head == 2 * 2048 * 128256 * 4096


def test_moe_layers_cost_their_routed_experts_and_the_balance_follows():
    from lightning_megatron.moe import MoEConfig
    config = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               moe=MoEConfig(hidden_size=64, ffn_hidden_size=256, num_experts=8, topk=2),
                               moe_layer_freq=2)
    costs = language_model_costs(config, 32, None)
    dense, moe = costs.layers[1], costs.layers[0]
    assert costs.layers == [moe, dense] * 4 and moe > 2 * dense
    layout = balanced_layout(costs.layers, 2)
    assert stage_costs(layout, costs.layers, 2) == [2 * moe + 2 * dense] * 2
    front_heavy = [moe, moe, moe, dense, dense, dense, dense, dense]
    weighted = balanced_layout(front_heavy, 2)
    assert weighted[0] < 4   # the even split would put all three MoE layers on stage 0
    assert slowest(weighted, front_heavy, 2, 0, 0) == min(slowest(c, front_heavy, 2, 0, 0)
                                                          for c in compositions(8, 2))


def test_chunk_and_stage_costs_add_the_ends():
    assert chunk_costs((1, 2, 0, 1), [1, 2, 3, 4], 10, 100) == [11, 5, 0, 104]
    assert stage_costs((1, 2, 0, 1), [1, 2, 3, 4], 2, 10, 100) == [11, 109]


def test_a_layout_by_hand_builds_its_layers_in_model_order():
    layout = (2, 3, 0, 1, 1, 1)   # pp 3, vp 2: stage 0 holds chunks 0 and 3, stage 1 chunks 1 and 4, ...
    chain = [chunk_layer_range(8, 3, v % 3, 2, v // 3, layout=layout) for v in range(6)]
    assert [list(r) for r in chain] == [[0, 1], [2, 3, 4], [], [5], [6], [7]]
    assert [virtual_stage(3, r, k) for k in range(2) for r in range(3)] == list(range(6))


def test_layout_errors_name_pipeline_layout_and_the_fix():
    with pytest.raises(ParallelConfigError, match=r"pipeline_layout has 3 entries, but pp_size \* vp_size = 2 \* 2 = "
                       r"4 virtual stages need one count each"):
        check_layout([2, 2, 4], 8, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"pipeline_layout=\[4, 3\] holds 7 layers, but the model has "
                       r"num_layers=8"):
        check_layout([4, 3], 8, 2)
    with pytest.raises(ParallelConfigError, match=r"layer counts \(integers >= 0\), got -1"):
        check_layout([9, -1], 8, 2)
    with pytest.raises(ParallelConfigError, match=r"'balanced' or 'even'; got 'balance'"):
        check_layout("balance", 8, 2)
    with pytest.raises(ParallelConfigError, match=r"pipeline_layout gives every stage its layers; "
                       r"first_stage_layers/last_stage_layers"):
        chunk_layer_range(8, 2, 0, first_stage_layers=1, layout=(4, 4))
