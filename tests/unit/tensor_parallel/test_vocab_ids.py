"""Input ids must lie in the real vocabulary: the rows past ``vocab_size`` are tensor-parallel padding
(zeros, dropped from checkpoints), so an id there would train silently on a row the model does not have."""

import os
from types import SimpleNamespace

import pytest
import torch

from lightning_megatron.models import BertModel, GPTModel
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.tensor_parallel import VocabParallelEmbedding, pad_vocab_size
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig

VOCAB, SEQ = 64, 8


def _config(mask, sequence_parallel):
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, attn_mask_type=mask, sequence_parallel=sequence_parallel)


def _errors_for_ids(tp, sequence_parallel=False):
    """What a GPT and a BERT model say about each id, by id: None when the forward pass ran."""
    import torch.distributed as dist

    ParallelState(ParallelLayout(dist.get_world_size(), tp=tp)).activate()
    padded = pad_vocab_size(VOCAB, tp)
    models = {"gpt": GPTModel(_config("causal", sequence_parallel), VOCAB, SEQ),
              "bert": BertModel(_config("padding", sequence_parallel), VOCAB, max_position_embeddings=SEQ)}
    out = {}
    for name, model in models.items():
        for bad in (0, VOCAB - 1, VOCAB, padded - 1, padded, -1):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
            ids[1, 3] = bad
            try:
                model(ids)
                out[name, bad] = None
            except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
                out[name, bad] = (type(err).__name__, str(err))
    return padded, out


@pytest.mark.parametrize("world, tp, sequence_parallel", [(1, 1, False), (2, 2, False), (2, 2, True)])
def test_ids_outside_the_vocabulary_are_rejected_by_gpt_and_bert(world, tp, sequence_parallel):
    per_rank = run_on_ranks(_errors_for_ids, world, tp, sequence_parallel, timeout=120)
    assert all(r == per_rank[0] for r in per_rank)        # every tp rank raises the same error
    padded, errors = per_rank[0]
    assert padded > VOCAB                                  # there are padding rows to fall into
    for model in ("gpt", "bert"):
        assert errors[model, 0] is None and errors[model, VOCAB - 1] is None
        for bad in (VOCAB, padded - 1, padded, -1):
            kind, message = errors[model, bad]
            assert kind == "ValueError", (model, bad, kind, message)
            assert f"input id {bad} " in message and f"vocab_size={VOCAB}" in message, message


def _embedding_message():
    from helpers.tp_utils import tp_state

    tp_state()
    emb = VocabParallelEmbedding(pad_vocab_size(10, 2, multiple=4), 4, vocab_size=10)
    try:
        emb(torch.tensor([[3, 12, 11], [2, 10, 5]]))
    except ValueError as err:
        return str(err)
    return None


def test_the_message_names_the_id_the_count_and_the_fix():
    messages = run_on_ranks(_embedding_message, 2, timeout=60)
    assert messages[0] == messages[1]
    message = messages[0]
    assert "input id 12 is outside the vocabulary [0, vocab_size=10)" in message
    assert "3 of the 6 ids" in message and "10 to 12" in message
    assert "padding" in message and "tokenizer" in message


def test_cuda_checks_only_with_the_debug_flag(monkeypatch):
    """On CUDA the host-side check (a device-to-host sync) runs only when asked for."""
    from lightning_megatron.tensor_parallel import CHECK_IDS_ENV, check_ids_on_host

    cpu = torch.zeros(2, dtype=torch.long)
    monkeypatch.delenv(CHECK_IDS_ENV, raising=False)
    assert check_ids_on_host(cpu, None)
    assert not check_ids_on_host(cpu, False)
    cuda = SimpleNamespace(device=torch.device("cuda"))      # only the device is looked at
    assert not check_ids_on_host(cuda, None)
    assert check_ids_on_host(cuda, True)
    monkeypatch.setenv(CHECK_IDS_ENV, "1")
    assert check_ids_on_host(cuda, None)
    monkeypatch.setenv(CHECK_IDS_ENV, "0")
    assert not check_ids_on_host(cuda, None)
    assert not check_ids_on_host(torch.empty(2, dtype=torch.long, device="meta"), True)   # holds no data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_ids_are_checked_without_a_host_sync_unless_the_flag_is_on(monkeypatch):
    run_on_ranks(_cuda_sync_free, 1, timeout=120)


def _cuda_sync_free():
    from helpers.tp_utils import tp_state

    from lightning_megatron.tensor_parallel import CHECK_IDS_ENV

    tp_state()
    emb = VocabParallelEmbedding(pad_vocab_size(10, 1, multiple=4), 4, vocab_size=10, device="cuda")
    good = torch.tensor([[1, 2, 3]], device="cuda")
    os.environ.pop(CHECK_IDS_ENV, None)
    torch.cuda.set_sync_debug_mode("error")
    try:
        emb(good)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    os.environ[CHECK_IDS_ENV] = "1"
    with pytest.raises(ValueError, match=r"input id 11 is outside the vocabulary \[0, vocab_size=10\)"):
        emb(torch.tensor([[1, 11, 3]], device="cuda"))
