"""Cross-entropy over vocab-parallel logits without gathering them (seed 002, section 3).

Each rank holds logits for its slice of the vocabulary. Instead of all-gathering b×s×V logits,
the ranks exchange b×s scalars: the running max (all-reduce MAX), then the target logit, the
sum of exponentials and, for label smoothing, the sum of logits (one all-reduce SUM of three
b×s tensors). Label smoothing is taken over the GLOBAL vocabulary, so the result equals
``F.cross_entropy(gathered_logits[..., :vocab_size], target, label_smoothing=α,
ignore_index=..., reduction="none")``; columns beyond ``vocab_size`` (vocabulary padding)
take no probability mass and never win.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .mappings import all_reduce, resolve_group
from .token_ids import check_ids_in_vocab


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, vocab_size, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        partition = logits.shape[-1]
        start = rank * partition
        real = max(0, min(partition, vocab_size - start))  # columns of this shard inside the vocab
        ctx.grad_dtype = logits.dtype
        logits = logits.float()
        if real < partition:
            logits = logits.clone()
            logits[..., real:] = float("-inf")

        logits_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        in_shard = (target >= start) & (target < start + partition) & ~ignored
        local_target = torch.where(in_shard, target - start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(in_shard, target_logit, torch.zeros_like(target_logit))
        exp = shifted.exp()
        sums = [target_logit, exp.sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(shifted[..., :real].sum(dim=-1))
        stats = all_reduce(torch.stack(sums), group)

        log_z = stats[1].log()
        loss = log_z - stats[0]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab_size)
        loss = torch.where(ignored, torch.zeros_like(loss), loss)

        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        ctx.save_for_backward(exp / stats[1].unsqueeze(-1), in_shard, local_target, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_shard, local_target, ignored = ctx.saved_tensors
        grad = softmax.clone()
        hit = torch.zeros_like(grad).scatter_(-1, local_target.unsqueeze(-1), in_shard.unsqueeze(-1).to(grad.dtype))
        grad -= (1.0 - ctx.label_smoothing) * hit
        if ctx.label_smoothing > 0:
            grad[..., :ctx.real] -= ctx.label_smoothing / ctx.vocab_size
        grad *= torch.where(ignored, torch.zeros_like(grad_loss), grad_loss).unsqueeze(-1)
        return grad.to(ctx.grad_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, ignore_index: int = -100,
                                 vocab_size: Optional[int] = None,
                                 group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Per-token loss (shape of ``target``; 0 where ``target == ignore_index``).

    ``vocab_parallel_logits``: ``[..., V_padded / tp]``, this rank's vocabulary slice.
    ``vocab_size``: the real vocabulary size (default: all ``V_padded`` columns are real).
    """
    group = resolve_group(group)
    padded = vocab_parallel_logits.shape[-1] * dist.get_world_size(group)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded}] (the padded vocabulary "
                         f"over {dist.get_world_size(group)} tensor-parallel ranks).")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target {tuple(target.shape)} "
                         "must agree on every dimension but the last.")
    # before any communication, so every tp rank raises it; on the host on the CPU, on the device on CUDA
    check_ids_in_vocab(target, vocab_size, what="label", padded_vocab_size=padded, ignore_index=ignore_index)
    if dist.get_world_size(group) == 1:
        # one shard holds the whole vocabulary: PyTorch's fused kernel, in float32 like the tp path
        logits = vocab_parallel_logits[..., :vocab_size].float()
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), target.reshape(-1), ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction="none")
        return loss.view(target.shape)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                            ignore_index, vocab_size, group)
