"""A tiny GPT trained a step or two at some layout, and its state seen as one process would see it."""

import torch
import torch.distributed as dist

from lightning_megatron.models import GPTModel
from lightning_megatron.models.sharding import full_of, global_names
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline import VirtualChunks, allreduce_shared_embedding_grads, forward_backward
from lightning_megatron.transformer import TransformerConfig

VOCAB, SEQ, MB, H = 100, 8, 2, 16


def config(**overrides):
    base = dict(num_layers=4, hidden_size=H, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                activation="swiglu", normalization="RMSNorm", add_bias_linear=False)  # swiglu: fc1 has stride 2
    base.update(overrides)
    return TransformerConfig(**base)


def activate(tp=1, pp=1, vpp=None, ep=1):
    layout = ParallelLayout(dist.get_world_size(), tp=tp, pp=pp, ep=ep)
    return ParallelState(layout, virtual_pipeline_size=vpp).activate()


def build_gpt(state, pipeline_layout=None, **overrides):
    cfg = config(**overrides)
    if state.virtual_pipeline_size:
        return VirtualChunks(lambda vp: GPTModel(cfg, VOCAB, SEQ, vp_rank=vp, pipeline_layout=pipeline_layout))
    return GPTModel(cfg, VOCAB, SEQ, pipeline_layout=pipeline_layout)


def chunks_of(model):
    return list(model.chunks) if isinstance(model, VirtualChunks) else [model]


def batches(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"ids": torch.randint(0, VOCAB, (MB, SEQ), generator=gen),
             "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=gen)} for _ in range(n)]


def _step(mb, chunk, ctx):
    out = chunk(mb["ids"], labels=mb["labels"])
    return out.mean() if ctx.is_last_stage else out


def run(model, state, data, optimizer=None):
    """Loss of ``data`` (every rank gets it); with ``optimizer`` also one training step."""
    chunks = chunks_of(model)
    out = forward_backward(_step, data, chunks, tensor_shape=(SEQ, MB, H), forward_only=optimizer is None,
                           pp_group=state.pp_group if state.pp_size > 1 else None)
    if optimizer is not None:
        allreduce_shared_embedding_grads(chunks)
        optimizer.step()
        optimizer.zero_grad()
    loss = torch.zeros(()) if out.loss is None else out.loss.detach().float()
    if state.pp_size > 1:
        dist.all_reduce(loss, group=state.pp_group)   # only the last stage holds it
    return loss


def global_view(model, optimizer, state):
    """``{global name: full tensor}`` of parameters and optimizer state, identical on every rank.

    Built without the checkpoint module: tp shards are gathered with ``full_of`` (which honours
    the stride), pipeline stages with ``all_gather_object``; vocabulary padding is cut off.
    """
    names = global_names(model)
    mine = {}
    for local_name, param in model.named_parameters():
        name = names[local_name]
        group = state.tp_group

        def full(t):
            f = full_of(t.detach(), param, group).clone()
            vocab = getattr(param, "vocab_size", None)
            return f[:vocab] if vocab is not None else f
        mine[name] = full(param)
        if optimizer is not None:
            for key, value in optimizer.state.get(param, {}).items():
                mine[f"{name}/{key}"] = full(value) if value.shape == param.shape else value.clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {}
    for part in gathered:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


def assert_same(a, b):
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def error_of(fn):
    """``(type name, message)`` of what ``fn()`` raises, or None: multi-rank tests return it to compare ranks."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    return None
