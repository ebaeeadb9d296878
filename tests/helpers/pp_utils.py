"""A tiny pipeline-able language model for executor tests, the same numbers in every layout.

Word embedding -> NUM_LAYERS residual blocks -> output layer tied to the embedding -> cross
entropy. Every block draws its weights from a seed of its global index, so a stage that builds
layers 4..5 holds exactly layers 4..5 of the single-stage model; the last stage's output weight
starts at zero and must be filled by ``sync_shared_embedding_weights``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_megatron.pipeline import chunk_layer_range, forward_backward
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, init_method_normal,
)

H, V, S, B = 8, 16, 4, 2   # hidden, vocab, sequence, micro-batch size (activations are S x B x H)
NUM_LAYERS = 8
STD = 0.3                  # large enough that tanh is not linear and gradients are not tiny
IGNORE = -100


def dense(n_in, n_out):
    """nn.Linear drawn exactly like a (Column|Row)ParallelLinear master weight; zero bias."""
    master = torch.empty(n_out, n_in)
    init_method_normal(STD)(master)
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init must not advance the stream
        layer = nn.Linear(n_in, n_out)
    with torch.no_grad():
        layer.weight.copy_(master)
        layer.bias.zero_()
    return layer


class Block(nn.Module):
    """x + fc2(tanh(fc1(x))). The final add saves nothing for backward, so freeing a sent block
    output really frees memory."""

    def __init__(self, index, tp=False):
        super().__init__()
        torch.manual_seed(1000 + index)
        if tp:
            self.fc1 = ColumnParallelLinear(H, 2 * H, init_method=init_method_normal(STD))
            self.fc2 = RowParallelLinear(2 * H, H, input_is_parallel=True,
                                         init_method=init_method_normal(STD))
        else:
            self.fc1, self.fc2 = dense(H, 2 * H), dense(2 * H, H)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def word_embedding():
    torch.manual_seed(999)
    return 0.5 * torch.randn(V, H)


class Chunk(nn.Module):
    """Layers ``layers`` of the model; the first chunk embeds, the last computes the loss."""

    def __init__(self, layers, first, last, tp=False, per_token=False):
        super().__init__()
        self.first, self.last, self.per_token = first, last, per_token
        self.embed = nn.Parameter(word_embedding()) if first else None
        self.layers = nn.ModuleDict({str(i): Block(i, tp) for i in layers})
        self.head = None
        if last:  # one Parameter when single-stage; else a copy that starts wrong on purpose
            self.head = self.embed if first else nn.Parameter(torch.zeros(V, H))
        for p in (self.embed, self.head):
            if p is not None:
                p.shared_embedding = True

    def forward(self, mb, input_tensor=None):
        x = F.embedding(mb["ids"], self.embed) if self.first else input_tensor
        for block in self.layers.values():
            x = block(x)
        if not self.last:
            return x
        logits = x @ self.head.t()
        loss = F.cross_entropy(logits.reshape(-1, V), mb["labels"].reshape(-1), ignore_index=IGNORE,
                               reduction="sum" if self.per_token else "mean")
        return loss, {"tokens": int((mb["labels"] != IGNORE).sum())}


def forward_step(mb, chunk, ctx):
    return chunk(mb, ctx.input_tensor)


def build_chunks(state, vp=None, tp=False, per_token=False):
    """This rank's chunks of the NUM_LAYERS-layer model under ``state``'s pipeline layout."""
    pp, rank = state.pp_size, state.pp_rank
    n = vp or 1
    return [Chunk(chunk_layer_range(NUM_LAYERS, pp, rank, vp, k), rank == 0 and k == 0,
                  rank == pp - 1 and k == n - 1, tp, per_token) for k in range(n)]


def microbatches(m, seed=0, varlen=False, per_token=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        s = S + (i % 3) if varlen else S
        labels = torch.randint(0, V, (s, B), generator=g)
        if per_token:  # uneven token counts per micro-batch
            labels[torch.rand(s, B, generator=g) < 0.1 + 0.15 * (i % 3)] = IGNORE
        out.append({"ids": torch.randint(0, V, (s, B), generator=g), "labels": labels})
    return out


def num_tokens(mbs):
    return sum(int((mb["labels"] != IGNORE).sum()) for mb in mbs)


def reference(m, varlen=False, per_token=False):
    """Loss and gradients (by global name) of the single-stage model, via the executor at pp=1."""
    chunk = Chunk(range(NUM_LAYERS), True, True, per_token=per_token)
    mbs = microbatches(m, varlen=varlen, per_token=per_token)
    out = forward_backward(forward_step, mbs, [chunk],
                           num_tokens=num_tokens(mbs) if per_token else None)
    return out.loss, {name: p.grad.clone() for name, p in chunk.named_parameters()}


def full_grads(chunks, state):
    """This rank's gradients by global name, tensor-parallel shards gathered to full tensors."""
    grads = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            g = p.grad
            if getattr(p, "tensor_model_parallel", False) and state.tp_size > 1:
                parts = [torch.empty_like(g) for _ in range(state.tp_size)]
                dist.all_gather(parts, g.contiguous(), group=state.tp_group)
                g = torch.cat(parts, dim=p.partition_dim)
            grads["embed" if name == "head" else name] = g.clone()
    return grads
