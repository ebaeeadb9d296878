"""Parallel layers equal their single-process counterparts: outputs and full (gathered) gradients."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, allreduce_sequence_parallel_grads,
    init_method_normal, pad_vocab_size, param_is_not_tensor_parallel_duplicate,
)
from lightning_megatron.tensor_parallel import mappings
from lightning_megatron.testing import run_on_ranks
from helpers.tp_utils import close, gather, tp_state

S, B, H = 8, 3, 16   # sequence, batch, hidden (sequence-first as in Megatron)
WORLDS = [1, 2, 4]


def master(shape, seed, std=0.02):
    torch.manual_seed(seed)
    w = torch.empty(shape)
    init_method_normal(std)(w)
    return w


def shard_seq(x, state):
    return x.chunk(state.tp_size, dim=0)[state.tp_rank]


# --- collectives ------------------------------------------------------------------------------------


def _collectives():
    state = tp_state()
    r, n = state.tp_rank, state.tp_size
    g = torch.arange(1.0, 1 + 4 * n * 2).view(2 * n, 4)  # an upstream gradient every rank knows
    x = torch.randn(2 * n, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    checks = {}

    # f: identity forward, all-reduce backward (each rank contributes g*(r+1))
    y = mappings.copy_to_tensor_parallel_region(x)
    (y * g * (r + 1)).sum().backward()
    checks["f"] = (torch.equal(y, x), torch.allclose(x.grad, g * sum(range(1, n + 1))))
    x.grad = None
    # g: all-reduce forward, identity backward
    y = mappings.reduce_from_tensor_parallel_region(x * (r + 1))
    (y * g).sum().backward()
    checks["g"] = (torch.allclose(y, x * sum(range(1, n + 1))), torch.allclose(x.grad, g * (r + 1)))
    x.grad = None
    # scatter / gather along the last dim are conjugate
    y = mappings.scatter_to_tensor_parallel_region(torch.cat([x] * n, dim=-1))
    z = mappings.gather_from_tensor_parallel_region(y)
    (z * torch.cat([g] * n, dim=-1)).sum().backward()
    checks["last"] = (torch.equal(y, x), torch.equal(z, torch.cat([x] * n, dim=-1)), torch.allclose(x.grad, g * n))
    x.grad = None
    # sequence: scatter first dim, gather with reduce-scatter backward, reduce-scatter forward
    y = mappings.scatter_to_sequence_parallel_region(x)
    checks["seq_scatter"] = torch.equal(y, x.chunk(n, 0)[r])
    z = mappings.gather_from_sequence_parallel_region(y, tensor_parallel_output_grad=True)
    (z * g).sum().backward()
    # every rank fed g for the full sequence: reduce-scatter sums n copies of this rank's slice
    checks["seq_gather"] = (torch.equal(z, x), torch.allclose(x.grad, g * n))
    x.grad = None
    z = mappings.gather_from_sequence_parallel_region(mappings.scatter_to_sequence_parallel_region(x),
                                                      tensor_parallel_output_grad=False)
    (z * g).sum().backward()
    checks["seq_gather_replicated"] = torch.allclose(x.grad, g)
    x.grad = None
    y = mappings.reduce_scatter_to_sequence_parallel_region(x * (r + 1))
    (y * g.chunk(n, 0)[r]).sum().backward()
    checks["seq_reduce_scatter"] = (torch.allclose(y, x.chunk(n, 0)[r] * sum(range(1, n + 1))),
                                    torch.allclose(x.grad, g * (r + 1)))
    return checks


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_and_their_conjugates(world):
    for checks in run_on_ranks(_collectives, world, timeout=60):
        for name, ok in checks.items():
            assert ok if isinstance(ok, bool) else all(ok), name


# --- column and row parallel linear -------------------------------------------------------------------


def _column(gather_output, sequence_parallel, bias):
    state = tp_state()
    w = master((4 * H, H), seed=7)
    torch.manual_seed(7)
    layer = ColumnParallelLinear(H, 4 * H, bias=bias, gather_output=gather_output,
                                 sequence_parallel=sequence_parallel)
    if bias:
        with torch.no_grad():  # a non-zero bias, sliced the same way
            b_full = torch.linspace(-1, 1, 4 * H)
            layer.bias.copy_(b_full.chunk(state.tp_size)[state.tp_rank])
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(S, B, 4 * H, generator=torch.Generator().manual_seed(2))
    ref_w = w.clone().requires_grad_()
    ref_b = b_full.clone().requires_grad_() if bias else None
    ref = F.linear(x, ref_w, ref_b)
    (ref * g).sum().backward()
    ref_dx, x.grad = x.grad.clone(), None

    inp = shard_seq(x, state).detach().requires_grad_() if sequence_parallel else x
    out = layer(inp)
    if gather_output:
        close(out, ref)
        (out * g).sum().backward()
    else:
        close(gather(out, -1, state), ref)
        (out * g.chunk(state.tp_size, -1)[state.tp_rank]).sum().backward()
    close(gather(layer.weight.grad, 0, state), ref_w.grad)
    if bias:
        close(gather(layer.bias.grad, 0, state), ref_b.grad)
    close(inp.grad, shard_seq(ref_dx, state) if sequence_parallel else ref_dx)
    return layer.weight.partition_dim, layer.weight.tensor_model_parallel


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("gather_output, sequence_parallel, bias",
                         [(False, False, True), (True, False, True), (False, True, True), (False, False, False)])
def test_column_parallel_linear_matches_linear(world, gather_output, sequence_parallel, bias):
    assert run_on_ranks(_column, world, gather_output, sequence_parallel, bias, timeout=60) == [(0, True)] * world


def _row(input_is_parallel, sequence_parallel, bias):
    state = tp_state()
    w = master((H, 4 * H), seed=11)
    torch.manual_seed(11)
    layer = RowParallelLinear(4 * H, H, bias=bias, input_is_parallel=input_is_parallel,
                              sequence_parallel=sequence_parallel)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.linspace(-1, 1, H))
    x = torch.randn(S, B, 4 * H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    ref_w = w.clone().requires_grad_()
    ref_b = torch.linspace(-1, 1, H).requires_grad_() if bias else None
    ref = F.linear(x, ref_w, ref_b)
    (ref * g).sum().backward()
    ref_dx, x.grad = x.grad.clone(), None

    inp = x.chunk(state.tp_size, -1)[state.tp_rank].detach().requires_grad_() if input_is_parallel else x
    out = layer(inp)
    if sequence_parallel:
        close(out, shard_seq(ref, state))
        (out * shard_seq(g, state)).sum().backward()
        allreduce_sequence_parallel_grads(layer.parameters())
    else:
        close(out, ref)
        (out * g).sum().backward()
    close(gather(layer.weight.grad, 1, state), ref_w.grad)
    if bias:
        close(layer.bias.grad, ref_b.grad)
    close(inp.grad, ref_dx.chunk(state.tp_size, -1)[state.tp_rank] if input_is_parallel else ref_dx)
    return param_is_not_tensor_parallel_duplicate(layer.weight), (
        param_is_not_tensor_parallel_duplicate(layer.bias) if bias else None)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("input_is_parallel, sequence_parallel, bias",
                         [(True, False, True), (False, False, True), (True, True, True), (True, False, False)])
def test_row_parallel_linear_matches_linear(world, input_is_parallel, sequence_parallel, bias):
    out = run_on_ranks(_row, world, input_is_parallel, sequence_parallel, bias, timeout=60)
    # weight shards always count; the replicated bias counts only on tp rank 0
    assert out == [(True, (r == 0) if bias else None) for r in range(world)]


# --- the paper's Figure 3: MLP and self-attention -----------------------------------------------------


def _mlp(sequence_parallel):
    state = tp_state()
    w1, w2 = master((4 * H, H), seed=21), master((H, 4 * H), seed=22)
    torch.manual_seed(21)
    fc1 = ColumnParallelLinear(H, 4 * H, sequence_parallel=sequence_parallel)
    torch.manual_seed(22)
    fc2 = RowParallelLinear(4 * H, H, input_is_parallel=True, sequence_parallel=sequence_parallel)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(6))
    r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ref = F.linear(F.gelu(F.linear(x, r1)), r2)
    (ref * g).sum().backward()
    ref_dx, x.grad = x.grad.clone(), None

    inp = shard_seq(x, state).detach().requires_grad_() if sequence_parallel else x
    out = fc2(F.gelu(fc1(inp)))
    if sequence_parallel:
        close(gather(out, 0, state), ref)
        (out * shard_seq(g, state)).sum().backward()
        close(gather(inp.grad, 0, state), ref_dx)
    else:
        close(out, ref)
        (out * g).sum().backward()
        close(inp.grad, ref_dx)
    close(gather(fc1.weight.grad, 0, state), r1.grad)
    close(gather(fc2.weight.grad, 1, state), r2.grad)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mlp_column_then_row_matches_single_process(world, sequence_parallel):
    run_on_ranks(_mlp, world, sequence_parallel, timeout=60)


def _attention(sequence_parallel):
    state = tp_state()
    heads, d = 4, H // 4
    w_qkv, w_o = master((3 * H, H), seed=31), master((H, H), seed=32)
    torch.manual_seed(31)
    qkv = ColumnParallelLinear(H, 3 * H, sequence_parallel=sequence_parallel)
    torch.manual_seed(32)
    proj = RowParallelLinear(H, H, input_is_parallel=True, sequence_parallel=sequence_parallel)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(8), requires_grad=True)
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(9))

    def attend(mixed, n_heads):  # [s, b, n_heads*3*d] laid out per head as (q, k, v)
        q, k, v = mixed.view(S, B, n_heads, 3, d).permute(3, 1, 2, 0, 4)  # 3 x [b, h, s, d]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return ctx.permute(2, 0, 1, 3).reshape(S, B, n_heads * d)

    rq, ro = w_qkv.clone().requires_grad_(), w_o.clone().requires_grad_()
    ref = F.linear(attend(F.linear(x, rq), heads), ro)
    (ref * g).sum().backward()
    ref_dx, x.grad = x.grad.clone(), None

    inp = shard_seq(x, state).detach().requires_grad_() if sequence_parallel else x
    out = proj(attend(qkv(inp), heads // state.tp_size))
    if sequence_parallel:
        close(gather(out, 0, state), ref)
        (out * shard_seq(g, state)).sum().backward()
        close(gather(inp.grad, 0, state), ref_dx)
    else:
        close(out, ref)
        (out * g).sum().backward()
        close(inp.grad, ref_dx)
    close(gather(qkv.weight.grad, 0, state), rq.grad)
    close(gather(proj.weight.grad, 1, state), ro.grad)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_self_attention_heads_split_matches_single_process(world, sequence_parallel):
    run_on_ranks(_attention, world, sequence_parallel, timeout=60)


# --- vocab-parallel embedding -------------------------------------------------------------------------


def _embedding(sequence_parallel):
    state = tp_state()
    vocab = pad_vocab_size(50, state.tp_size, multiple=4)
    w = master((vocab, H), seed=41, std=1.0)
    torch.manual_seed(41)
    emb = VocabParallelEmbedding(vocab, H, init_method=init_method_normal(1.0),
                                 sequence_parallel=sequence_parallel)
    ids = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(10))
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(12))
    ref_w = w.clone().requires_grad_()
    ref = F.embedding(ids, ref_w)
    (ref * g).sum().backward()
    out = emb(ids)
    if sequence_parallel:
        close(out, shard_seq(ref, state))
        (out * shard_seq(g, state)).sum().backward()
    else:
        close(out, ref)
        (out * g).sum().backward()
    close(gather(emb.weight.grad, 0, state), ref_w.grad)
    return emb.vocab_start, emb.vocab_end


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_matches_embedding(world, sequence_parallel):
    ranges = run_on_ranks(_embedding, world, sequence_parallel, timeout=60)
    vocab = pad_vocab_size(50, world, multiple=4)
    assert ranges == [(r * vocab // world, (r + 1) * vocab // world) for r in range(world)]


def test_out_of_range_ids_are_rejected():
    emb_error = run_on_ranks(_embedding_out_of_range, 2, timeout=60)
    assert all("input id 8 is outside the vocabulary [0, vocab_size=8)" in e for e in emb_error)


def _embedding_out_of_range():
    tp_state()
    emb = VocabParallelEmbedding(8, 4)
    try:
        emb(torch.tensor([[3, 8]]))
    except ValueError as err:
        return str(err)
    return "no error"


# --- divisibility errors --------------------------------------------------------------------------------


def _divisibility_errors():
    tp_state()
    errors = []
    for build in (lambda: ColumnParallelLinear(8, 6), lambda: RowParallelLinear(6, 8),
                  lambda: VocabParallelEmbedding(50, 8), lambda: RowParallelLinear(8, 8, sequence_parallel=True),
                  lambda: ColumnParallelLinear(8, 8, gather_output=True, sequence_parallel=True)):
        try:
            build()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_divisibility_errors_name_the_parameter_on_every_rank():
    out = run_on_ranks(_divisibility_errors, 4, timeout=60)
    assert all(o == out[0] for o in out)
    col, row, emb, row_sp, col_sp = out[0]
    assert "output_size=6 is not divisible by the tensor-parallel size 4" in col and "e.g. 4 or 8" in col
    assert "input_size=6 is not divisible by the tensor-parallel size 4" in row
    assert "num_embeddings (padded vocabulary)=50 is not divisible" in emb
    assert "needs input_is_parallel=True" in row_sp
    assert "cannot be combined with sequence_parallel" in col_sp


def test_pad_vocab_size_follows_the_paper():
    assert pad_vocab_size(50257, 8) == 51200          # seed 002: GPT-2's vocabulary at 8-way TP
    assert pad_vocab_size(30522, 1) == 30592          # BERT's vocabulary, multiple of 128
    assert pad_vocab_size(128, 1) == 128
    with pytest.raises(ValueError, match="positive sizes"):
        pad_vocab_size(0, 2)
