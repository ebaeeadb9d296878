"""Vocab-parallel cross-entropy equals F.cross_entropy on the gathered, unpadded logits."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.tensor_parallel import pad_vocab_size, vocab_parallel_cross_entropy
from lightning_megatron.testing import run_on_ranks
from helpers.tp_utils import close, gather, tp_state

B, S, VOCAB = 3, 5, 50


def _cross_entropy(label_smoothing, padded, huge_padding_logits):
    state = tp_state()
    n = state.tp_size
    total = pad_vocab_size(VOCAB, n, multiple=4) if padded else VOCAB - VOCAB % n
    vocab = VOCAB if padded else total
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, total, generator=gen) * 3
    if padded and huge_padding_logits:
        logits[..., vocab:] = 1e4  # padding must never win, however large its logits are
    target = torch.randint(0, vocab, (B, S), generator=gen)
    target[0, :2] = -100   # ignored positions
    target[1, 0] = vocab - 1  # a target in the last real column (the last shard when padded)
    weights = torch.rand(B, S, generator=gen)

    ref_logits = logits[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.permute(0, 2, 1), target, label_smoothing=label_smoothing,
                          ignore_index=-100, reduction="none")
    (ref * weights).sum().backward()

    local = logits.chunk(n, -1)[state.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=label_smoothing, vocab_size=vocab)
    (loss * weights).sum().backward()
    close(loss, ref)
    full_grad = gather(local.grad, -1, state)
    close(full_grad[..., :vocab], ref_logits.grad)
    assert torch.count_nonzero(full_grad[..., vocab:]) == 0
    assert torch.all(loss[0, :2] == 0) and torch.all(local.grad[0, :2] == 0)
    return loss.detach()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_cross_entropy_on_gathered_logits(world, label_smoothing, padded):
    losses = run_on_ranks(_cross_entropy, world, label_smoothing, padded, padded, timeout=60)
    assert all(torch.equal(l, losses[0]) for l in losses)  # every tp rank reports the same loss


def _bfloat16_logits():
    state = tp_state()
    logits = torch.randn(B, S, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    target = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))
    local = logits.chunk(state.tp_size, -1)[state.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    loss.sum().backward()
    ref = F.cross_entropy(logits.float().permute(0, 2, 1), target, reduction="none")
    close(loss, ref)
    return loss.dtype, local.grad.dtype


def test_low_precision_logits_are_reduced_in_float32():
    assert run_on_ranks(_bfloat16_logits, 2, timeout=60) == [(torch.float32, torch.bfloat16)] * 2


def _bad_arguments():
    tp_state()
    logits = torch.randn(2, 8)
    errors = []
    for kwargs in (dict(vocab_size=17), dict(label_smoothing=1.0), dict(target=torch.zeros(3, dtype=torch.long))):
        target = kwargs.pop("target", torch.zeros(2, dtype=torch.long))
        try:
            vocab_parallel_cross_entropy(logits, target, **kwargs)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    try:
        vocab_parallel_cross_entropy(logits, torch.tensor([0, 16]), vocab_size=16)
        errors.append(None)
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_bad_arguments_are_named():
    errors = run_on_ranks(_bad_arguments, 2, timeout=60)
    assert errors[0] == errors[1]
    size, smoothing, shape, target = errors[0]
    assert "vocab_size=17 must be in [1, 16]" in size
    assert "label_smoothing must be in [0, 1)" in smoothing
    assert "must agree on every dimension but the last" in shape
    assert "label 16 is outside the vocabulary [0, vocab_size=16)" in target
