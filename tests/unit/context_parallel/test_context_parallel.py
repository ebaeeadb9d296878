"""Context parallelism: the load-balanced split, the attention over gathered keys, and GPT/BERT at
CP=2/4 (alone, with TP=2, with SP) against CP=1: same per-token loss and, summed over cp, the same
gradients."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.tensor_parallel import get_rng_tracker
from lightning_megatron.context_parallel import (
    all_gather_context_parallel, chunk_order, context_parallel_loss_mean, context_parallel_position_ids,
    gather_context_parallel_slices, split_for_context_parallel,
)
from lightning_megatron.models import BertModel, GPTModel
from lightning_megatron.parallel import ParallelLayout, ParallelState, RankGenerator
from lightning_megatron.parallel.topology import ParallelConfigError
from lightning_megatron.tensor_parallel import allreduce_sequence_parallel_grads, model_parallel_seed
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.transformer.context_parallel import (
    context_parallel_attention, context_parallel_rng_fork, local_query_attention,
)
from lightning_megatron.testing import run_on_ranks
from helpers.tp_utils import close, full_grad

VOCAB, SEQ, BATCH = 100, 16, 2


# -- the split (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_is_load_balanced_and_gather_inverts_it(cp):
    x = torch.arange(2 * 8 * cp * 3).view(2, 8 * cp, 3)
    slices = [split_for_context_parallel(x, cp, r) for r in range(cp)]
    chunk = 8 * cp // (2 * cp)
    for r, piece in enumerate(slices):
        expected = torch.cat([x[:, r * chunk:(r + 1) * chunk], x[:, (2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk]], 1)
        assert torch.equal(piece, expected)
        assert torch.equal(context_parallel_position_ids(8, cp, r), split_for_context_parallel(
            torch.arange(8 * cp), cp, r, seq_dim=0))
    assert torch.equal(gather_context_parallel_slices(slices), x)
    assert torch.equal(gather_context_parallel_slices([split_for_context_parallel(x, cp, r, seq_dim=-2)
                                                       for r in range(cp)], seq_dim=-2), x)
    assert sorted(chunk_order(cp)) == list(range(2 * cp))


def test_split_of_a_batch_dict_splits_sequences_and_passes_the_rest():
    batch = {"input_ids": torch.arange(16).view(2, 8), "attention_mask": torch.ones(2, 8),
             "label": torch.tensor([0, 1]), "name": "x"}
    out = split_for_context_parallel(batch, 2, 1)
    assert out["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["attention_mask"].shape == (2, 4) and torch.equal(out["label"], batch["label"]) and out["name"] == "x"
    only = split_for_context_parallel(batch, 2, 0, keys=["input_ids"])
    assert only["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]] and only["attention_mask"].shape == (2, 8)


def test_split_errors_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]: sequence length \(dim 1\) 10 is not divisible by "
                                         r"2\*cp_size = 4.*e\.g\. 8 or 12"):
        split_for_context_parallel({"input_ids": torch.zeros(2, 10)}, 2, 0)
    with pytest.raises(ValueError, match=r"divisible by 2\*cp_size = 8.*e\.g\. 8\.$"):
        split_for_context_parallel(torch.zeros(1, 6), 4, 0)
    with pytest.raises(ValueError, match=r"cp_rank must be an integer in \[0, 2\)"):
        split_for_context_parallel(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        split_for_context_parallel(torch.zeros(1, 8), 0, 0)
    with pytest.raises(KeyError, match=r"keys \['labels'\] are not in the batch"):
        split_for_context_parallel({"input_ids": torch.zeros(1, 8)}, 2, 0, keys=["labels"])


def test_cp_with_ep_needs_moe_folding():
    with pytest.raises(ParallelConfigError, match="cannot both exceed 1"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2)
    layout = ParallelLayout(4, cp=2, ep=2)            # folded: attention over (cp, dp), experts over (ep, edp)
    assert layout.groups("cp") == [[0, 1], [2, 3]] and layout.groups("dp-cp") == [[0, 1, 2, 3]]
    assert layout.groups("ep") == [[0, 1], [2, 3]] and layout.groups("edp") == [[0, 2], [1, 3]]


# -- the local attention against SDPA on the whole sequence (pure, every simulated rank) ------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("causal,padded", [(True, False), (True, True), (False, True), (False, False)])
def test_local_query_attention_equals_full_sdpa(cp, causal, padded):
    gen = torch.Generator().manual_seed(cp)
    b, heads, s, d = 2, 3, 8 * cp, 4
    q, k, v = (torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, s - 3:] = False                                          # right padding on one row
    mask = keep[:, None, None, :] if padded else None
    if causal:
        mask = torch.ones(s, s, dtype=torch.bool).tril() & (mask if padded else True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    weight = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    outs, grads = [], [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(cp):
        q_r = split_for_context_parallel(q.detach(), cp, r, seq_dim=2).requires_grad_()
        k_all, v_all = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = local_query_attention(q_r, k_all, v_all, keep if padded else None, causal, 0.0, cp, r)
        dq, dk, dv = torch.autograd.grad((out * split_for_context_parallel(weight, cp, r, seq_dim=2)).sum(),
                                         (q_r, k_all, v_all))
        outs.append(out.detach())
        grads[0] += _place(dq, cp, r)
        grads[1] += dk                                               # the all-gather's backward sums these
        grads[2] += dv
    torch.testing.assert_close(gather_context_parallel_slices(outs, seq_dim=2), ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def _place(local, cp, rank):
    """This rank's slice written into a zero tensor of the whole sequence (dim 2)."""
    full = [torch.zeros_like(local) for _ in range(cp)]
    full[rank] = local
    return gather_context_parallel_slices(full, seq_dim=2)


# -- GPT and BERT against CP=1 (multi-rank) --------------------------------------------------------------


def _config(**overrides):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(overrides)
    return TransformerConfig(**base)


def _gpt_batch(padded):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[1, SEQ - 5:] = 0                     # right padding: its tokens are masked keys and carry no loss
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}, padded


def _cp_grads(model, state):
    """Every parameter's full gradient: tp shards gathered, then SUMMED over cp (each rank's share)."""
    allreduce_sequence_parallel_grads(model.parameters())
    grads = {}
    for name, param in model.named_parameters():
        grad = full_grad(param, state).clone()
        if state.cp_size > 1:
            dist.all_reduce(grad, group=state.cp_group)
        grads[name] = grad
    return grads


def _run_gpt(state, batch, padded, **overrides):
    state.activate()
    local = split_for_context_parallel(batch, state.cp_size, state.cp_rank)
    model = GPTModel(_config(**overrides), VOCAB, max_sequence_length=SEQ)
    mask = local["attention_mask"] if padded else None
    per_token = model(local["input_ids"], attention_mask=mask, labels=local["labels"])        # [b, s/cp]
    loss = context_parallel_loss_mean(per_token, local["attention_mask"])
    loss.backward()
    grads = _cp_grads(model, state)
    table = "embedding.word_embeddings.weight"
    grads[table] = grads[table][:VOCAB]
    return all_gather_context_parallel(per_token.detach(), seq_dim=1), loss.detach(), grads


def _bert_batch():
    gen = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen),
             "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ),
             "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    batch["attention_mask"][0, SEQ - 6:] = 0
    batch["input_ids"][0, SEQ - 6:] = 0
    return batch, torch.randn(16, generator=gen)


def _run_bert(state, batch, probe, **overrides):
    state.activate()
    local = split_for_context_parallel(batch, state.cp_size, state.cp_rank)
    model = BertModel(_config(layernorm_order="post", attn_mask_type="padding", **overrides), VOCAB,
                      max_position_embeddings=SEQ)
    out = model(local["input_ids"], local["attention_mask"], local["token_type_ids"])
    per_token = out.hidden_states @ probe                                                  # [b, s/cp]
    # token part: this rank's share; the pooled part is replicated over cp, so each rank takes 1/cp
    loss = context_parallel_loss_mean(per_token.square(), local["attention_mask"]) + out.pooled.sum() / state.cp_size
    loss.backward()
    grads = _cp_grads(model, state)
    grads["embedding.word_embeddings.weight"] = grads["embedding.word_embeddings.weight"][:VOCAB]
    hidden = all_gather_context_parallel(out.hidden_states.detach(), seq_dim=1)
    return hidden, out.pooled.detach(), grads


def _same(out, ref):
    close(out[0], ref[0])
    close(out[1], ref[1])
    assert out[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(out[2][name], ref[2][name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _equivalence(layouts):
    """``layouts``: (tp, cp, sequence_parallel) tuples run on this world, each against CP=1."""
    world = dist.get_world_size()
    checked = []
    for padded in (False, True):
        batch = _gpt_batch(padded)
        ref = _run_gpt(ParallelState(ParallelLayout(world)), *batch)
        for tp, cp, sp in layouts:
            _same(_run_gpt(ParallelState(ParallelLayout(world, tp=tp, cp=cp)), *batch, sequence_parallel=sp), ref)
            checked.append(("gpt", tp, cp, sp, padded))
    batch, probe = _bert_batch()
    ref = _run_bert(ParallelState(ParallelLayout(world)), batch, probe)
    for tp, cp, sp in layouts:
        _same(_run_bert(ParallelState(ParallelLayout(world, tp=tp, cp=cp)), batch, probe, sequence_parallel=sp), ref)
        checked.append(("bert", tp, cp, sp, True))
    return checked


def test_cp2_matches_cp1():
    assert len(run_on_ranks(_equivalence, 2, [(1, 2, False)], timeout=120)[0]) == 3


def test_cp4_and_tp2_cp2_with_and_without_sp_match_cp1():
    layouts = [(1, 4, False), (2, 2, False), (2, 2, True)]
    assert len(run_on_ranks(_equivalence, 4, layouts, timeout=150)[0]) == 9


# -- the collective core, dropout, recomputation, errors (multi-rank) ----------------------------------------------------------


def _attention_dropout_and_errors():
    state = ParallelState(ParallelLayout(2, cp=2)).activate()
    out = {}
    # the collective core against SDPA on the whole sequence: outputs and q/k/v gradients (reduce-scattered)
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(2, 3, SEQ, 4, generator=gen, requires_grad=True) for _ in range(3)]
    weight = torch.randn(2, 3, SEQ, 4, generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, SEQ - 4:] = 0
    ref = F.scaled_dot_product_attention(*full, attn_mask=torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
                                         & mask.bool()[:, None, None, :])
    (ref * weight).sum().backward()
    split = lambda t: split_for_context_parallel(t.detach(), 2, state.cp_rank, seq_dim=2)  # noqa: E731
    local = [split(t).requires_grad_() for t in full]
    got = context_parallel_attention(*local, attention_mask=split_for_context_parallel(mask, 2, state.cp_rank))
    (got * split(weight)).sum().backward()
    close(all_gather_context_parallel(got.detach(), seq_dim=2), ref.detach())
    for mine, whole in zip(local, full):
        close(mine.grad, split(whole.grad))
    # the same local q/k/v on both cp ranks: equal without dropout, different masks with it
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
    plain = context_parallel_attention(q, k, v, causal=False)
    dropped = context_parallel_attention(q, k, v, causal=False, dropout_p=0.5,
                                         rng=context_parallel_rng_fork(get_rng_tracker(state), state.cp_rank))
    out["plain"], out["dropped"] = plain, dropped

    # recomputation replays the attention-dropout masks; a fresh seed reproduces the run
    batch, _ = _gpt_batch(False)
    local = split_for_context_parallel(batch, 2, state.cp_rank)
    runs = []
    for recompute in (False, True, False):
        model = GPTModel(_config(attention_dropout=0.3, hidden_dropout=0.2, recompute_layers=recompute), VOCAB, SEQ)
        model_parallel_seed(5)
        loss = context_parallel_loss_mean(model(local["input_ids"], labels=local["labels"]))
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    out["runs"] = runs

    errors = []
    model = GPTModel(_config(), VOCAB, SEQ)
    for call in (lambda: model(torch.zeros(1, 7, dtype=torch.long)),
                 lambda: model(local["input_ids"], attention_mask=batch["attention_mask"]),
                 lambda: model(torch.zeros(1, SEQ, dtype=torch.long))):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    return out


def test_attention_core_dropout_and_errors_under_cp():
    ranks = run_on_ranks(_attention_dropout_and_errors, 2, timeout=120)
    assert torch.equal(ranks[0]["plain"], ranks[1]["plain"])
    assert not torch.equal(ranks[0]["dropped"], ranks[1]["dropped"])            # each cp rank its own stream
    for rank in ranks:
        (loss0, grads0), (loss1, grads1), (loss2, grads2) = rank["runs"]
        assert torch.equal(loss0, loss1) and torch.equal(loss0, loss2)
        for a, b, c in zip(grads0, grads1, grads2):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
            assert torch.equal(a, c)
        odd, full_mask, too_long = rank["errors"]
        assert "local sequence length 7 is odd" in odd and "2*cp_size = 4" in odd
        assert "attention_mask has 16 positions but this context-parallel rank holds 8 tokens" in full_mask
        assert "sequence length 32 (16 on each of 2 context-parallel ranks) exceeds max_sequence_length=16" in too_long
