"""BERT pre- and post-norm train on a tiny task; task heads; PipelineStack builds per stage."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_megatron.models import (
    BertForMaskedLM, BertForMultipleChoice, BertForSequenceClassification, BertModel,
)
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline.stack import PipelineStack
from lightning_megatron.tensor_parallel import vocab_parallel_cross_entropy
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.testing import run_on_ranks

VOCAB = 30


def config(order, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                layernorm_order=order, attn_mask_type="padding", init_method_std=0.05)
    base.update(kw)
    return TransformerConfig(**base)


def _train_classifier(order):
    world = dist.get_world_size()
    ParallelState(ParallelLayout(world, tp=world)).activate()
    torch.manual_seed(0)
    model = BertForSequenceClassification(config(order), VOCAB, num_labels=2, max_position_embeddings=16)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        ids = torch.randint(3, 9, (16, 12), generator=gen)
        labels = (ids[:, 1] < 6).long()                 # learnable: is the first word "small"?
        ids[:, 0] = 1                                   # [CLS]
        mask = torch.ones_like(ids)
        mask[:8, 9:] = 0                                # padded tail on half the batch
        ids[:8, 9:] = 0
        loss = F.cross_entropy(model(ids, mask), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("order", ["pre", "post"])
def test_bert_trains_with_decreasing_loss(order):
    losses = run_on_ranks(_train_classifier, 2, order, timeout=180)
    assert losses[0] == losses[1]                            # tp ranks agree
    first, last = sum(losses[0][:5]) / 5, sum(losses[0][-5:]) / 5
    assert last < 0.6 * first, (first, last)


def _heads():
    ParallelState(ParallelLayout(2, tp=2)).activate()
    cfg = config("post")
    ids = torch.randint(1, VOCAB, (3, 4, 10), generator=torch.Generator().manual_seed(0))
    choice = BertForMultipleChoice(cfg, VOCAB, max_position_embeddings=16)(ids)
    mlm = BertForMaskedLM(cfg, VOCAB, max_position_embeddings=16)
    labels = torch.full((3, 10), -100)
    labels[:, 2] = 5
    loss = mlm(ids[:, 0], labels=labels)
    logits = mlm(ids[:, 0])
    # the masked-LM loss is the vocab-parallel cross-entropy of the head's logits
    ref = vocab_parallel_cross_entropy(logits, labels, vocab_size=VOCAB)
    return tuple(choice.shape), tuple(loss.shape), torch.equal(loss, ref), bool((loss[:, 3] == 0).all())


def test_multiple_choice_and_masked_lm_heads():
    assert run_on_ranks(_heads, 2, timeout=60) == [((3, 4), (3, 10), True, True)] * 2


def test_bert_rejects_a_causal_config():
    # checked before any process group is needed
    with pytest.raises(ValueError, match="attn_mask_type='padding'"):
        BertModel(config("post", attn_mask_type="causal"), VOCAB)


class Block(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def _stack(pp, vpp, **split):
    state = ParallelState(ParallelLayout(dist.get_world_size(), pp=pp), virtual_pipeline_size=vpp).activate()
    chunks = [PipelineStack(Block, num_layers=8, vp_rank=v, **split) for v in range(vpp or 1)]
    return [(c.layer_indices, c.pre_process, c.post_process, [l.linear.weight.sum().item() for l in c.layers])
            for c in chunks]


def test_pipeline_stack_balanced_without_costs_is_refused():
    with pytest.raises(Exception, match=r"pipeline_layout='balanced' needs the layers' costs \(layer_costs=\[\.\.\.\]"):
        run_on_ranks(_stack, 2, 2, None, pipeline_layout="balanced", timeout=60)
    with pytest.raises(Exception, match=r"pipeline_layout='balanced' got 3 layer costs for num_layers=8"):
        run_on_ranks(_stack, 2, 2, None, pipeline_layout="balanced", layer_costs=[1, 2, 3], timeout=60)


def test_pipeline_stack_builds_this_stage_with_layout_independent_weights():
    whole = run_on_ranks(_stack, 1, 1, None, timeout=60)[0][0]
    weight_of = dict(zip(whole[0], whole[3]))
    stages = run_on_ranks(_stack, 2, 2, 2, timeout=60)
    assert [[c[0] for c in s] for s in stages] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]   # seed 000
    assert [[(c[1], c[2]) for c in s] for s in stages] == [[(True, False), (False, False)],
                                                            [(False, False), (False, True)]]
    for stage in stages:
        for indices, _, _, sums in stage:
            assert [weight_of[i] for i in indices] == sums
    # by hand, and balanced by the user's own costs (the two 5s are the expensive layers)
    by_hand = run_on_ranks(_stack, 2, 2, 2, pipeline_layout=[1, 4, 0, 3], timeout=60)
    assert [[c[0] for c in s] for s in by_hand] == [[[0], []], [[1, 2, 3, 4], [5, 6, 7]]]
    for stage in by_hand:
        for indices, _, _, sums in stage:
            assert [weight_of[i] for i in indices] == sums
    balanced = run_on_ranks(_stack, 2, 2, None, pipeline_layout="balanced", layer_costs=[1, 1, 1, 1, 5, 5, 1, 1],
                            timeout=60)
    assert [s[0][0] for s in balanced] == [[0, 1, 2, 3, 4], [5, 6, 7]]   # 9 and 7, not 4 and 12
