"""permute/unpermute restore values and gradients exactly; chunk regrouping; dispatcher metadata."""

import torch

from lightning_megatron.moe import DispatchMetadata, permute, permute_probs, unpermute
from lightning_megatron.moe.permute import chunk_sort_index, inverse_permutation


def _routing(num_tokens, num_experts, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=-1).indices
    return torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)


def test_permute_groups_rows_by_expert_in_token_order():
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    tokens = torch.arange(3.0).unsqueeze(1)
    rows, slots = permute(tokens, routing_map, 6)
    assert rows.flatten().tolist() == [0, 2, 1, 2, 0, 1]          # expert 0: t0 t2, expert 1: t1 t2, ...
    assert slots.tolist() == [0, 2, 4, 5, 6, 7]                     # slot = e*T + t


def test_round_trip_restores_values_and_gradients_exactly():
    for topk in (1, 3):
        routing_map = _routing(16, 8, topk, seed=topk)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        rows, slots = permute(x, routing_map, 16 * topk)
        back = unpermute(rows, slots, 16)
        assert torch.equal(back, x.detach() * topk)               # each token is summed k times
        g = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        back.backward(g)
        assert torch.equal(x.grad, g * topk)


def test_unpermute_weights_rows_by_their_probabilities():
    routing_map = _routing(12, 6, 2, seed=3)
    probs = torch.rand(12, 6, generator=torch.Generator().manual_seed(4)) * routing_map
    probs.requires_grad_()
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(5), requires_grad=True)
    rows, slots = permute(x, routing_map, 24)
    out = unpermute(rows * 2.0, slots, 12, permute_probs(probs, slots))
    torch.testing.assert_close(out, 2.0 * probs.sum(1, keepdim=True) * x)
    out.sum().backward()
    torch.testing.assert_close(probs.grad, (2.0 * x.sum(1, keepdim=True) * routing_map).detach())


def test_permute_with_fewer_rows_than_routed_slots_has_a_static_shape():
    routing_map = _routing(8, 4, 2, seed=6)
    rows, slots = permute(torch.randn(8, 3), routing_map, 5)
    assert rows.shape == (5, 3) and slots.shape == (5,)


def test_chunk_sort_regroups_sources_by_expert_and_back():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])                  # 2 sources x 3 experts
    labels = [(s, e) for s in range(2) for e in range(3) for _ in range(counts[s, e])]
    idx = chunk_sort_index(counts, 7)
    assert [labels[i] for i in idx.tolist()] == sorted(labels, key=lambda se: (se[1], se[0]))
    inv = inverse_permutation(idx)
    assert idx[inv].tolist() == list(range(7))


def test_dispatch_metadata_tensors_round_trip():
    meta = DispatchMetadata(num_tokens=4, routing_map=torch.ones(4, 2, dtype=torch.bool),
                            tokens_per_expert=torch.tensor([4, 4]))
    saved = meta.tensors()
    assert set(saved) == {"routing_map", "tokens_per_expert"}
    fresh = DispatchMetadata(num_tokens=4)
    fresh.load_tensors(saved)
    assert torch.equal(fresh.tokens_per_expert, meta.tokens_per_expert)


def test_layer_phases_resume_from_saved_metadata():
    """What a partial CUDA graph does: run route + preprocess, keep their outputs and the
    dispatcher's metadata tensors, then finish dispatch/experts/combine from those alone."""
    from lightning_megatron.moe import MoEConfig, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, topk=2))
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1))
    expected = layer(x)
    probs, routing_map = layer.route(x)
    tokens, row_probs = layer.preprocess(x.reshape(-1, 8), probs, routing_map)
    saved = {k: v.clone() for k, v in layer.dispatcher.meta.tensors().items()}
    layer(torch.randn_like(x))                                     # another micro-batch in between
    layer.dispatcher.meta.load_tensors(saved)                      # the graph replay's outputs
    out = layer.combine(layer.experts_compute(*layer.dispatch(tokens, row_probs)))
    torch.testing.assert_close(out.view_as(x), expected)


def test_per_token_path_equals_the_general_path_in_values_and_gradients():
    """The dropless fast path (gathers instead of index_add) gives the general path's rows, outputs
    and gradients of tokens, rows and probabilities."""
    from lightning_megatron.moe.permute import permute_per_token, unpermute_per_token

    for topk in (1, 2, 3):
        routing_map = _routing(20, 6, topk, seed=10 + topk)
        gen = torch.Generator().manual_seed(topk)
        x0, probs0 = torch.randn(20, 5, generator=gen), torch.rand(20, 6, generator=gen) * routing_map
        g_rows, g_out = torch.randn(20 * topk, 5, generator=gen), torch.randn(20, 5, generator=gen)
        results = []
        for fast in (False, True):
            x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
            if fast:
                rows, slots, order = permute_per_token(x, routing_map, topk)
            else:
                rows, slots = permute(x, routing_map, 20 * topk)
            mid = rows * 2.0 + 1.0
            out = (unpermute_per_token(mid, order, 20, permute_probs(probs, slots)) if fast
                   else unpermute(mid, slots, 20, permute_probs(probs, slots)))
            ((rows * g_rows).sum() + (out * g_out).sum()).backward()
            results.append((rows.detach(), slots, out.detach(), x.grad, probs.grad))
        for plain, fast in zip(*results):
            torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
        _, slots, _, _, _ = results[1]
        order = permute_per_token(x0, routing_map, topk)[2]
        tokens = (slots % 20)[order]
        assert torch.equal(tokens, torch.arange(20).repeat_interleave(topk))     # rows listed token by token


def test_gather_permutation_backward_is_the_inverse_gather():
    from lightning_megatron.moe.permute import gather_permutation

    index = torch.randperm(9, generator=torch.Generator().manual_seed(0))
    x = torch.randn(9, 3, requires_grad=True)
    y = gather_permutation(x, index)
    g = torch.randn(9, 3)
    y.backward(g)
    assert torch.equal(y, x.detach()[index])
    assert torch.equal(x.grad, torch.zeros(9, 3).index_add(0, index, g))


def test_kernel_switch_and_cpu_fallback(monkeypatch):
    """CPU tensors always take the torch path (no token lists), whatever the switch says; the switch and
    ``LM_MOE_PERMUTE_KERNELS=0`` turn the kernels off where they would run."""
    from lightning_megatron.moe import permute_indexed
    from lightning_megatron.ops import moe_permute as permute_kernels

    with permute_kernels.kernels_enabled(False):
        assert not permute_kernels.enabled()
    with permute_kernels.kernels_enabled(True):
        assert permute_kernels.enabled() == (permute_kernels.triton is not None)
        routing_map = _routing(10, 4, 2, seed=7)
        x = torch.randn(10, 3)
        rows, slots, token_rows = permute_indexed(x, routing_map, 20)
        assert token_rows is None
        assert torch.equal(rows, permute(x, routing_map, 20)[0])
        out = unpermute(rows, slots, 10, token_rows=torch.zeros(10, 4, dtype=torch.long))   # ignored on the CPU
        assert torch.equal(out, unpermute(rows, slots, 10))
    monkeypatch.setenv(permute_kernels.ENV, "0")
    assert not permute_kernels.enabled()
