"""GPT through the pipeline executor: PP=2/4, with and without VPP=2, and TP2xPP2 give the loss and
every parameter gradient (tied embeddings included) of the PP=1 model after one step."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.distributed import finalize_model_grads
from lightning_megatron.models import GPTModel
from lightning_megatron.models.sharding import full_of, global_name, layer_index_maps
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline import VirtualChunks, forward_backward
from lightning_megatron.transformer import TransformerConfig
from lightning_megatron.testing import run_on_ranks

VOCAB, SEQ, MB, M = 50, 8, 2, 4   # vocabulary, sequence, micro-batch size, micro-batches


def _grads(tp, pp, vp):
    world = dist.get_world_size()
    state = ParallelState(ParallelLayout(world, tp=tp, pp=pp), virtual_pipeline_size=vp).activate()
    cfg = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0)
    model = VirtualChunks(lambda v: GPTModel(cfg, VOCAB, SEQ, vp_rank=v))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (M * MB, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (M * MB, SEQ), generator=gen)
    micro = [(ids[i * MB:(i + 1) * MB], labels[i * MB:(i + 1) * MB]) for i in range(M)]

    def step(mb, _chunk, ctx):
        return model(mb[0], labels=mb[1] if ctx.is_last_stage else None).mean() if ctx.is_last_stage \
            else model(mb[0])

    out = forward_backward(step, micro, [model] * (vp or 1), dtype=torch.float32, tensor_shape=(SEQ, MB, 16),
                           pp_group=state.pp_group if pp > 1 else None)
    finalize_model_grads([model], state)   # tied-embedding sum over the embedding group (and dp)
    grads = {}
    for chunk in model.chunks:
        maps = layer_index_maps(chunk)
        for name, param in chunk.named_parameters():
            name = "output_weight" if name == "output_weight" else global_name(name, maps)
            grads[name] = full_of(param.grad, param, state.tp_group)
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    merged = {}
    for part in gathered:
        merged.update(part)
    loss = out.loss
    box = [None if loss is None else float(loss)]
    dist.broadcast_object_list(box, src=state.ranks("pp")[-1], group=state.pp_group)
    return box[0], merged


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_grads, 1, 1, 1, None, timeout=120)[0]


@pytest.mark.parametrize("world, tp, pp, vp", [(2, 1, 2, None), (4, 1, 4, None), (2, 1, 2, 2), (4, 2, 2, None)])
def test_pipelined_gpt_equals_single_stage(reference, world, tp, pp, vp):
    ref_loss, ref_grads = reference
    loss, grads = run_on_ranks(_grads, world, tp, pp, vp, timeout=180)[0]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    tied = grads.pop("output_weight", None)
    if tied is not None:   # the last stage's twin received the summed gradient too
        torch.testing.assert_close(tied, grads["embedding.word_embeddings.weight"], atol=1e-6, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        got = grads[name]
        if name == "embedding.word_embeddings.weight":     # padded rows differ with tp: compare the real ones
            got, grad = got[:VOCAB], grad[:VOCAB]
        torch.testing.assert_close(got, grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
