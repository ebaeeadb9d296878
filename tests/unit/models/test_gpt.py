"""GPT at TP=1/2/4 (and with sequence parallelism): same logits and gradients from the same seed."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.tensor_parallel import allreduce_sequence_parallel_grads
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.testing import run_on_ranks
from helpers.tp_utils import close, full_grad, full_param, gather

VOCAB, SEQ, BATCH = 100, 8, 2


def config(**overrides):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(overrides)
    return TransformerConfig(**base)


def run_gpt(state, cfg, ids, labels, mask=None):
    state.activate()
    model = GPTModel(cfg, VOCAB, max_sequence_length=SEQ)
    logits = model(ids, attention_mask=mask)
    loss = model(ids, attention_mask=mask, labels=labels)
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model.parameters())  # the strategy's finalize step
    full_logits = gather(logits, -1, state)[..., :VOCAB]
    params = {n: full_param(p, state) for n, p in model.named_parameters()}
    grads = {n: full_grad(p, state) for n, p in model.named_parameters()}
    table = "embedding.word_embeddings.weight"  # padded to 128·tp rows: only the real rows compare
    assert torch.count_nonzero(params[table][VOCAB:]) == 0 and torch.count_nonzero(grads[table][VOCAB:]) == 0
    params[table], grads[table] = params[table][:VOCAB], grads[table][:VOCAB]
    return full_logits, loss.detach(), params, grads


def _tp_equivalence(overrides, sequence_parallel):
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    ref = run_gpt(ParallelState(ParallelLayout(world, tp=1)), config(**overrides), ids, labels)
    out = run_gpt(ParallelState(ParallelLayout(world, tp=world)),
                  config(sequence_parallel=sequence_parallel, **overrides), ids, labels)
    close(out[0], ref[0])
    close(out[1], ref[1])
    assert out[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(out[2][name], ref[2][name], atol=0, rtol=0, msg=name)  # same init
        torch.testing.assert_close(out[3][name], ref[3][name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return sorted(ref[2])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_tensor_parallel_matches_single_rank(world):
    names = run_on_ranks(_tp_equivalence, world, {}, False, timeout=120)[0]
    assert "embedding.word_embeddings.weight" in names and "decoder.final_norm.weight" in names


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_sequence_parallel_matches_single_rank(world):
    run_on_ranks(_tp_equivalence, world, {}, True, timeout=120)


def test_gpt_swiglu_rmsnorm_matches_single_rank():
    run_on_ranks(_tp_equivalence, 2, dict(activation="swiglu", normalization="RMSNorm", add_bias_linear=False),
                 True, timeout=120)


def _padding_matches_unpadded():
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=dist.get_world_size())).activate()
    model = GPTModel(config(), VOCAB, max_sequence_length=SEQ).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = [SEQ, 5]
    rows = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    ids = torch.zeros(len(rows), SEQ, dtype=torch.long)
    mask = torch.zeros(len(rows), SEQ, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row     # right padding
        mask[i, :len(row)] = 1
    with torch.no_grad():
        batched = gather(model(ids, attention_mask=mask), -1, state)
        for i, row in enumerate(rows):
            alone = gather(model(row[None]), -1, state)
            close(batched[i, :len(row)], alone[0])
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_padded_batch_equals_sequences_one_by_one(world):
    assert run_on_ranks(_padding_matches_unpadded, world, timeout=60) == [True] * world


def test_config_errors_say_the_fix():
    with pytest.raises(ValueError, match="hidden_size=10 is not divisible by num_attention_heads=4"):
        TransformerConfig(num_layers=1, hidden_size=10, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"activation='relu' is not one of \['gelu', 'gelu_tanh', 'swiglu', 'geglu'\]"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, activation="relu")
    with pytest.raises(ValueError, match="hidden_dropout must be in"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, hidden_dropout=1.5)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        TransformerConfig(num_layers=0, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="embedding_multiplier must be a positive number, got 0"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, embedding_multiplier=0)
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma must be True or False, got 'yes'"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, layernorm_zero_centered_gamma="yes")


def _heads_not_divisible():
    ParallelState(ParallelLayout(4, tp=4)).activate()
    try:
        GPTModel(config(num_attention_heads=2, hidden_size=16), VOCAB, SEQ)
    except ValueError as err:
        return str(err)


def test_heads_not_divisible_by_tp_is_named_on_every_rank():
    out = run_on_ranks(_heads_not_divisible, 4, timeout=60)
    assert all(o == out[0] for o in out)
    assert "num_attention_heads=2 is not divisible by tensor_model_parallel_size=4" in out[0]
