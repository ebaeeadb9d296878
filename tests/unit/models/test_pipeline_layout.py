"""``GPTModel(pipeline_layout=...)`` and ``BertForMaskedLM``: which layers every pipeline stage builds by default
(balanced by counted cost), by name ("even") and by hand, and one error on every rank for a bad one."""

import pytest
import torch.distributed as dist

from lightning_megatron.models import GPTModel
from lightning_megatron.models.bert import BertForMaskedLM, BertForSequenceClassification
from lightning_megatron.parallel import ParallelConfigError, ParallelLayout, ParallelState
from lightning_megatron.parallel.stage_balance import balanced_layout
from lightning_megatron.parallel.stages import split_layout
from lightning_megatron.pipeline import VirtualChunks
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.transformer.stage_costs import language_model_costs

# a large vocabulary for the width: the output layer and loss cost several layers
H, LAYERS, VOCAB, SEQ = 32, 8, 4096, 16


def gpt_config(**overrides):
    return TransformerConfig(**dict(dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=4), **overrides))


def _built(pp, vpp, pipeline_layout, kwargs):
    state = ParallelState(ParallelLayout(dist.get_world_size(), pp=pp), virtual_pipeline_size=vpp).activate()
    model = VirtualChunks(lambda vp: GPTModel(gpt_config(), VOCAB, SEQ, vp_rank=vp, pipeline_layout=pipeline_layout,
                                              **kwargs))
    try:
        return [(chunk.pipeline_layout, chunk.decoder.layer_indices) for chunk in model.chunks]
    finally:
        state.destroy()


def build(pp, vpp=None, pipeline_layout=None, **kwargs):
    """Per rank, per local chunk: (the layout the chunk resolved, its global layer indices)."""
    return run_on_ranks(_built, pp, pp, vpp, pipeline_layout, kwargs, timeout=120)


def chain(out, pp, vpp=1):
    """Every virtual stage's layers, in model order."""
    return [out[v % pp][v // pp][1] for v in range(pp * vpp)]


def test_default_balances_the_output_layer_and_loss_against_the_layers():
    costs = language_model_costs(gpt_config(), SEQ, VOCAB)
    assert costs.head > 2 * costs.layers[0]
    expected = balanced_layout(costs.layers, 4, None, costs.embedding, costs.head)
    assert expected[-1] < expected[0] and expected != split_layout(LAYERS, 4)
    out = build(4)
    assert {rank[0][0] for rank in out} == {expected}
    starts = [sum(expected[:v]) for v in range(4)]
    assert chain(out, 4) == [list(range(s, s + n)) for s, n in zip(starts, expected)]


def test_default_with_virtual_stages_and_the_chunked_loss_costing_more():
    costs = language_model_costs(gpt_config(), SEQ, VOCAB, recompute_output_layer=True)
    expected = balanced_layout(costs.layers, 2, 2, costs.embedding, costs.head)
    out = build(2, 2, cross_entropy_chunk_size=8)
    assert out[0][0][0] == expected
    assert [i for chunk in chain(out, 2, 2) for i in chunk] == list(range(LAYERS))
    assert [len(c) for c in chain(out, 2, 2)] == list(expected)


def test_even_by_hand_and_the_pinned_ends():
    assert chain(build(2, pipeline_layout="even"), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chain(build(2, 2, pipeline_layout=[1, 4, 0, 3]), 2, 2) == [[0], [1, 2, 3, 4], [], [5, 6, 7]]
    assert chain(build(2, first_stage_layers=6), 2) == [[0, 1, 2, 3, 4, 5], [6, 7]]


def test_a_bad_layout_is_refused_on_every_rank():
    for layout, message in (([4, 3], r"pipeline_layout=\[4, 3\] holds 7 layers, but the model has num_layers=8"),
                            ("fast", r"'balanced' or 'even'; got 'fast'")):
        with pytest.raises(Exception, match=message) as raised:
            build(2, pipeline_layout=layout)
        assert str(raised.value).count("ParallelConfigError") >= 1
    with pytest.raises(Exception, match=r"pipeline_layout='even' and first_stage_layers/last_stage_layers both"):
        build(2, pipeline_layout="even", last_stage_layers=2)


def _bert_layouts():
    state = ParallelState(ParallelLayout(2, pp=2)).activate()
    config = TransformerConfig(num_layers=8, hidden_size=32, num_attention_heads=4, attn_mask_type="padding",
                               layernorm_order="post")
    try:
        return (BertForMaskedLM(config, 8192, max_position_embeddings=64).bert.pipeline_layout,
                BertForSequenceClassification(config, 8192, 3, max_position_embeddings=64).bert.pipeline_layout)
    finally:
        state.destroy()


def test_bert_counts_the_masked_lm_head_and_not_a_classifier():
    masked_lm, classifier = run_on_ranks(_bert_layouts, 2, timeout=120)[0]
    assert classifier == (4, 4)
    assert masked_lm[1] < masked_lm[0] and sum(masked_lm) == 8
