"""Pure routing functions: scores, (group-limited) top-k, expert capacity and token dropping.

Everything here is a function of tensors with static output shapes (``[T, E]`` in, ``[T, E]``
out): no ``.item()``, ``nonzero()`` or boolean-mask indexing, so a router built from them can be
captured in a CUDA graph. Ties are broken by position (stable sorts), so a plain Python loop can
reproduce every decision exactly.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def check_group_limits(num_experts: int, topk: int, num_groups: Optional[int],
                       group_topk: Optional[int]) -> None:
    """Raise a ValueError naming the parameter when group-limited routing cannot work."""
    if (num_groups is None) != (group_topk is None):
        raise ValueError("group-limited routing needs both num_groups and group_topk (or neither); "
                         f"got num_groups={num_groups}, group_topk={group_topk}.")
    if num_groups is None:
        return
    assert group_topk is not None   # given together with num_groups (checked above)
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_experts={num_experts} must be divisible by num_groups={num_groups}; "
                         "choose num_groups among the divisors of num_experts.")
    if not 1 <= group_topk <= num_groups:
        raise ValueError(f"group_topk={group_topk} must be in [1, num_groups={num_groups}].")
    if topk % group_topk:
        raise ValueError(f"topk={topk} must be divisible by group_topk={group_topk}: each selected group "
                         "is scored by the sum of its top (topk // group_topk) experts.")
    if topk // group_topk > num_experts // num_groups:
        raise ValueError(f"topk // group_topk = {topk // group_topk} exceeds the {num_experts // num_groups} "
                         "experts of one group; raise group_topk or lower topk.")


def group_limited_topk(scores: Tensor, topk: int, num_groups: int, group_topk: int) -> Tuple[Tensor, Tensor]:
    """Top-k restricted to the ``group_topk`` best expert groups (DeepSeek-V3 node-limited routing).

    A group's score is the sum of its best ``topk // group_topk`` scores; experts outside the
    chosen groups are masked with -inf before the final top-k. Returns (values, indices) ``[T, k]``.
    """
    num_tokens, num_experts = scores.shape
    per_group = num_experts // num_groups
    grouped = scores.view(num_tokens, num_groups, per_group)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)            # [T, G]
    group_idx = group_scores.topk(group_topk, dim=-1).indices                             # [T, g]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, per_group).reshape(num_tokens, -1)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _select(selection: Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]) -> Tensor:
    if num_groups is not None:
        assert group_topk is not None   # check_group_limits: given together with num_groups
        return group_limited_topk(selection, topk, num_groups, group_topk)[1]
    return selection.topk(topk, dim=-1).indices


def topk_routing(logits: Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 expert_bias: Optional[Tensor] = None, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None,
                 scaling_factor: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Route each token to ``topk`` experts. Returns ``(probs [T, E], routing_map [T, E] bool)``.

    - softmax, ``pre_softmax=False`` (Mixtral): top-k of the logits, softmax over those k.
    - softmax, ``pre_softmax=True`` (Switch/DeepSeek-V2): softmax over all experts, keep top-k.
    - sigmoid (DeepSeek-V3): independent sigmoid scores, top-k, renormalized when k > 1.

    ``expert_bias`` (aux-loss-free balancing) shifts only the *selection*; the returned
    probabilities are the unbiased scores. ``scaling_factor`` multiplies the final probs.
    """
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}.")
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
    elif pre_softmax:
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits  # softmax is taken over the k selected logits below
    selection = scores if expert_bias is None else scores + expert_bias.float()
    indices = _select(selection, topk, num_groups, group_topk)
    picked = scores.gather(1, indices)
    if score_function == "softmax" and not pre_softmax:
        picked = torch.softmax(picked, dim=-1)
    elif score_function == "sigmoid" and topk > 1:
        picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        picked = picked * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, picked)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def scores_for_aux_loss(logits: Tensor, score_function: str) -> Tensor:
    """Per-token scores over *all* experts, summing to one, that the balancing losses average."""
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, dim=-1)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert may take from ``num_tokens`` local tokens: ``ceil(T·k/E · factor)`` in [1, T]."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}.")
    capacity = math.ceil(num_tokens * topk / num_experts * capacity_factor)
    return max(1, min(capacity, num_tokens))


def apply_capacity(probs: Tensor, routing_map: Tensor, capacity: int, drop_policy: str = "probs",
                   pad_to_capacity: bool = False) -> Tuple[Tensor, Tensor]:
    """Keep at most ``capacity`` tokens per expert; optionally pad every expert to exactly that many.

    ``drop_policy="probs"`` keeps each expert's highest-probability tokens, ``"position"`` its
    earliest ones; ties go to the earlier token. With ``pad_to_capacity`` each expert column
    selects exactly ``capacity`` tokens (routed ones first, then unrouted ones with probability
    0), so every later shape is static; padded rows add nothing to outputs or gradients.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}.")
    num_tokens = routing_map.shape[0]
    if not 1 <= capacity <= num_tokens:
        raise ValueError(f"capacity={capacity} must be in [1, num_tokens={num_tokens}].")
    routed = routing_map.to(probs.dtype)
    # Routed tokens always rank above unrouted ones (priority >= 1 vs 0 ... + the tie-breaking key).
    priority = routed + (probs.detach() if drop_policy == "probs" else 0.0)
    order = torch.sort(priority, dim=0, descending=True, stable=True).indices[:capacity]   # [cap, E]
    keep = torch.zeros_like(routing_map).scatter(0, order, True)
    kept_map = keep if pad_to_capacity else routing_map & keep
    return probs * kept_map, kept_map
