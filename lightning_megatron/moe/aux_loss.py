"""Router balancing losses, how their gradients reach the model, and how they are reported.

Invariance to TP/CP: the router sees this rank's tokens only (a slice of the micro-batch's
sequences: sequence parallelism splits them over tp, context parallelism over cp). Each loss
below is written as a *sum over local tokens* of a per-token term whose global statistics (token
counts per expert, total token count) are all-reduced over ``group`` -- the tp-cp group. So the
local values are partial sums: adding them over the tp-cp group gives exactly the loss of the
whole sequences at TP=CP=1, and each rank's gradient is exactly that loss's gradient for its own
tokens. (z-loss, a mean, divides by the group size instead.)

Invariance to the micro-batch count: the loss is not added to the user's loss; its gradient
is injected during backward by :class:`AttachAuxLoss` and multiplied by the router's
``aux_loss_scale``. The training loop sets it with :func:`set_aux_loss_scale` to the factor its
main loss is multiplied by (``1 / num_microbatches``, times any loss scale), so the summed
gradient over micro-batches is the mean, as for the main loss. Under context parallelism the
gradients are averaged over the cp ranks (each holds a per-token mean of its share), while the
balancing losses are partial sums over them: the scale is then multiplied by the cp size.

Per-token main losses (the strategy's ``calculate_per_token_loss``): the main loss is a sum over
tokens and the gradients are divided by the global token count after the step. Each micro-batch's
balancing loss is then multiplied by its token count (``per_token=True``, as Megatron-Core does),
so when every token carries a label it weighs exactly what it weighs with mean losses.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def sum_over(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """All-reduce (sum) without autograd: token counts carry no gradient."""
    if group_size(group) == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x


def switch_load_balancing_loss(scores: Tensor, routing_map: Tensor, topk: int, coeff: float,
                               group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """``coeff · E/k · Σ_e f_e · P_e`` (Switch Transformer, generalized to top-k); this rank's part.

    ``f_e`` = tokens routed to e / all tokens, ``P_e`` = mean score of e over all tokens, where
    "all" means the tokens of the whole tp-cp group. Equals ``coeff`` for perfectly uniform routing.
    """
    num_tokens, num_experts = scores.shape
    counts = sum_over(routing_map.sum(dim=0).float(), group)
    total = num_tokens * group_size(group)
    return (scores.sum(dim=0) * counts).sum() * (coeff * num_experts / (topk * total * total))


def sequence_load_balancing_loss(scores: Tensor, routing_map: Tensor, topk: int, coeff: float,
                                 group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The same balance term per sequence, averaged over the batch (DeepSeek-V2/V3 "seq aux loss").

    ``scores``/``routing_map`` are ``[S_local, B, E]`` (sequence-first); the sequence dimension
    may be split over ``group`` (tp-cp), whose counts are summed.
    """
    seq_local, batch, num_experts = scores.shape
    counts = sum_over(routing_map.sum(dim=0).float(), group)                    # [B, E]
    seq_len = seq_local * group_size(group)
    balance = counts * (num_experts / (topk * seq_len))
    return (balance * scores.sum(dim=0) / seq_len).sum() * (coeff / batch)


def z_loss(logits: Tensor, coeff: float, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """``coeff · mean(logsumexp(logits)²)`` (ST-MoE); this rank's share of the tp-cp mean."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * (coeff / group_size(group))


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; during backward, also sends ``scale`` as the gradient of ``aux_loss``.

    Attaching the loss to an activation that reaches the main loss makes its gradient flow
    through the same backward pass (and the same pipeline schedule) without changing the
    loss the user computes or logs.
    """

    @staticmethod
    def forward(ctx, x: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None
