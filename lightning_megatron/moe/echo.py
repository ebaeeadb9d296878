"""ECHO: the expert-offloading planner (seed 004, "Expert权重分发与梯度收集机制").

Every EP rank hosts ``E / R`` home experts plus ``k`` spare expert slots
(``R`` = number of EP ranks, ``k`` = ``num_spare_experts_per_ep_rank``,
``S = R * k`` spare slots in all; slot ``j`` lives on EP rank ``j // k``).
When the router overloads some EP ranks, the planner copies an overloaded home
expert into spare slots on underloaded ranks and reroutes part of its tokens
there, so every rank computes roughly ``avg = sum(tokens) // R`` tokens.

The pipeline, each step a pure function of tensors:

1. ``gen_intermediate``: spare capacity per EP rank and spillover per home expert
   (sort -> cumsum -> clamp -> diff).
2. ``one_shot_greedy_assignment``: interval overlap of cumulative sums.
3. ``gen_assignment``: keep the ``k`` largest greedy pieces per EP rank ->
   tokens from home expert ``e`` to spare slot ``j``, shape ``[E, S]``.
4. ``breadth_first_allocation`` + ``depth_first_allocation``: which source EP
   rank sends how many of those tokens.
5. ``apply_offloading_plan``: reroute this rank's routing map / probs.

``gen_offloading_plan`` runs all five. Steps 1-4 read only the all-gathered
``[R, E]`` token counts, so every EP rank computes the same plan.

CUDA graphs: all shapes depend only on ``(T, E, R, k)``; there is no ``.item()``,
``.tolist()``, ``nonzero()`` or boolean-mask indexing, and every intermediate
stays on the input's device, so the whole plan can be captured. Counts are
computed in int64, with exact integer arithmetic, so the plan does not depend on
the device, the float rounding mode or the reduction order.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

__all__ = [
    "gen_intermediate",
    "tolerance_per_mille",
    "one_shot_greedy_assignment",
    "gen_assignment",
    "breadth_first_allocation",
    "depth_first_allocation",
    "home_expert_of_spare",
    "apply_offloading_plan",
    "interleave_spare_slots",
    "home_expert_of_column",
    "gen_offloading_plan",
    "plan_token_moves",
    "token_moves",
    "reroute_probs",
    "TokenMoves",
    "OffloadingPlan",
]


# --------------------------------------------------------------------------- helpers


def _interval_overlap(count_tokens_per_chunk: Tensor, capacity_per_bucket: Tensor) -> Tensor:
    """Overlap of consecutive chunk intervals with consecutive bucket intervals.

    Batched over leading dims: ``[..., C]`` x ``[..., B]`` -> ``[..., C, B]``.
    Chunk ``i`` covers ``[sum(c[:i]), sum(c[:i+1]))``, bucket ``j`` likewise;
    the answer is ``max(0, min(ends) - max(starts))``.
    """
    chunk_end = count_tokens_per_chunk.cumsum(dim=-1)
    chunk_start = chunk_end - count_tokens_per_chunk
    bucket_end = capacity_per_bucket.cumsum(dim=-1)
    bucket_start = bucket_end - capacity_per_bucket
    overlap_start = torch.maximum(chunk_start.unsqueeze(-1), bucket_start.unsqueeze(-2))
    overlap_end = torch.minimum(chunk_end.unsqueeze(-1), bucket_end.unsqueeze(-2))
    return (overlap_end - overlap_start).clamp(min=0)


def _spillover_in_order(count_tokens: Tensor, capacity: Tensor) -> Tensor:
    """Spillover of each chunk when chunks fill ``capacity`` in the given order.

    ``cumsum -> - capacity -> clamp(min=0) -> diff``: only the part of the running
    total above ``capacity`` spills, so the spillovers sum to exactly
    ``max(0, sum - capacity)`` (a per-chunk ``count - capacity / n`` overshoots).
    """
    spillover_cumsum = (count_tokens.cumsum(dim=-1) - capacity).clamp(min=0)
    return torch.cat([spillover_cumsum[..., :1], torch.diff(spillover_cumsum, dim=-1)], dim=-1)


def _inverse_permutation(indices: Tensor) -> Tensor:
    """``inv`` with ``inv[indices[i]] = i`` (scatter, not a second sort)."""
    positions = torch.arange(indices.shape[-1], device=indices.device).expand_as(indices)
    return torch.empty_like(indices).scatter_(-1, indices, positions)


def _select_row(x: Tensor, ep_rank: Tensor | int) -> Tensor:
    """``x[ep_rank]`` without turning a device tensor into a Python int (a host sync)."""
    if isinstance(ep_rank, Tensor):
        return x.index_select(0, ep_rank.reshape(1).to(device=x.device, dtype=torch.long)).squeeze(0)
    return x[ep_rank]


def _check_counts(count_tokens_per_expert_from_ep_rank: Tensor, num_ep_ranks: int | None) -> int:
    """Validate the ``[sources, E]`` count matrix (shapes only, never values) and return ``R``.

    Rows are the ranks that send tokens: the EP ranks, or the ``etp x ep`` ranks of the
    expert model-parallel group when experts are also tensor-parallel. ``R`` (where experts
    live) defaults to the number of rows.
    """
    if count_tokens_per_expert_from_ep_rank.dim() != 2:
        raise ValueError("count_tokens_per_expert_from_ep_rank must be [num_source_ranks, num_experts]")
    num_from_ranks, num_experts = count_tokens_per_expert_from_ep_rank.shape
    num_ep_ranks = num_from_ranks if num_ep_ranks is None else num_ep_ranks
    if num_ep_ranks < 1:
        raise ValueError(f"num_ep_ranks must be >= 1, got {num_ep_ranks}")
    if num_experts % num_ep_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_ep_ranks={num_ep_ranks}")
    return num_ep_ranks


# --------------------------------------------------------------------------- planner


def tolerance_per_mille(tolerance: float) -> int:
    """``tolerance`` (a fraction of the mean load, >= 0) in whole per-mille: the planner's integer arithmetic."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be a fraction >= 0 of the mean load, got {tolerance!r}.")
    return int(round(tolerance * 1000))


def spill_limit(avg_tokens_per_ep_rank: Any, tolerance: float) -> Any:
    """The load above which an EP rank spills: ``avg + avg * tolerance`` in whole per-mille (integer arithmetic, on
    a device tensor in the planner or a host int in :func:`any_rank_spills`)."""
    return avg_tokens_per_ep_rank + avg_tokens_per_ep_rank * tolerance_per_mille(tolerance) // 1000


def any_rank_spills(tokens_per_ep_rank: Sequence[int], tolerance: float) -> bool:
    """Whether the planner would spill anything for these per-EP-rank loads (host ints): some load above
    :func:`spill_limit` of their mean. False means no token would move, so the plan can be skipped."""
    avg = sum(tokens_per_ep_rank) // len(tokens_per_ep_rank)
    limit = spill_limit(avg, tolerance)
    return any(load > limit for load in tokens_per_ep_rank)


def gen_intermediate(
    count_tokens_per_expert_from_ep_rank: Tensor,
    ep_rank: Tensor | int | None = None,
    num_ep_ranks: int | None = None,
    tolerance: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Spillover per home expert and spare capacity per EP rank.

    Args:
        count_tokens_per_expert_from_ep_rank: ``[R, E]`` int, row ``r`` = tokens
            that source EP rank ``r`` routes to each expert (the all-gathered
            ``routing_map.sum(0)``). Experts ``[i*E/R, (i+1)*E/R)`` live on rank ``i``.
        ep_rank: ignored; accepted for Megatron-Core's positional signature. The
            result does not depend on it, which is why all ranks agree.
        num_ep_ranks: ``R``; defaults to the number of rows.
        tolerance: an EP rank spills only its load above ``limit = avg + avg * tolerance``
            (in whole per-mille, integer arithmetic): imbalance within it is left alone, and routing
            within it everywhere uses no spare slot (so no expert weights move). 0: spill above ``avg``.

    Returns:
        ``(count_spillover_per_home_expert [E], capacity_spare_per_ep_rank [R],
        avg_tokens_per_ep_rank [])``, all int64. ``avg = sum // R`` is each EP
        rank's capacity. ``spare = relu(avg - load)``. Within each rank, experts
        are sorted ascending so light experts keep their tokens and heavy ones spill
        (stable sort: equal counts spill from the higher index). Per rank, the
        spillover sums to ``relu(load - limit)``.
    """
    num_ep_ranks = _check_counts(count_tokens_per_expert_from_ep_rank, num_ep_ranks)
    count_tokens_per_expert = count_tokens_per_expert_from_ep_rank.long().sum(dim=0)
    count_tokens_per_local_expert = count_tokens_per_expert.view(num_ep_ranks, -1)
    count_tokens_per_ep_rank = count_tokens_per_local_expert.sum(dim=1)
    avg_tokens_per_ep_rank = count_tokens_per_ep_rank.sum() // num_ep_ranks
    limit = spill_limit(avg_tokens_per_ep_rank, tolerance)

    deviation = count_tokens_per_ep_rank - avg_tokens_per_ep_rank
    capacity_spare_per_ep_rank = torch.relu(-deviation)

    count_tokens_sorted, indices_sorted = count_tokens_per_local_expert.sort(dim=1, stable=True)
    count_spillover_sorted = _spillover_in_order(count_tokens_sorted, limit)
    count_spillover = torch.zeros_like(count_spillover_sorted).scatter_(1, indices_sorted, count_spillover_sorted)
    return count_spillover.view(-1), capacity_spare_per_ep_rank, avg_tokens_per_ep_rank


def one_shot_greedy_assignment(count_tokens_per_chunk: Tensor, capacity_per_bucket: Tensor) -> Tensor:
    """Greedy fill of buckets by chunks, in order, in one shot (no loop).

    Lay chunks end to end on one line and buckets end to end on another;
    ``assignment[i, j]`` is the length of the overlap of chunk ``i``'s interval with
    bucket ``j``'s. Equal to filling bucket 0 then bucket 1 ... with chunk 0 then
    chunk 1 ..., splitting a chunk across buckets where it does not fit.

    Args:
        count_tokens_per_chunk: ``[C]`` non-negative int.
        capacity_per_bucket: ``[B]`` non-negative int.

    Returns:
        ``[C, B]`` assignment; rows sum to at most the chunk, columns to at most
        the bucket, and the total is ``min(sum(chunks), sum(buckets))``.
    """
    return _interval_overlap(count_tokens_per_chunk, capacity_per_bucket)


def _match_spillover_to_spare_slots(
    count_spillover_per_home_expert: Tensor,
    capacity_spare_per_ep_rank: Tensor,
    num_spare_experts_per_ep_rank: int,
) -> Tensor:
    """``[E]`` spillover x ``[R]`` spare capacity -> ``[E, R*k]`` tokens per spare slot.

    Both sides are sorted descending (largest spillover meets largest spare
    capacity), matched by ``one_shot_greedy_assignment``, unsorted, and each EP
    rank keeps its ``k`` largest pieces: slot ``r*k + s`` gets the ``s``-th
    largest. A dropped piece simply stays home. Stable sorts make ties resolve
    to the lower index, so the result is a pure function of the values.
    """
    num_experts = count_spillover_per_home_expert.shape[0]
    num_ep_ranks = capacity_spare_per_ep_rank.shape[0]
    k = num_spare_experts_per_ep_rank

    count_spillover_sorted, indices_spillover_sort = count_spillover_per_home_expert.sort(descending=True, stable=True)
    capacity_spare_sorted, indices_spare_sort = capacity_spare_per_ep_rank.sort(descending=True, stable=True)
    assignment_sorted = one_shot_greedy_assignment(count_spillover_sorted, capacity_spare_sorted)
    assignment = assignment_sorted.index_select(0, _inverse_permutation(indices_spillover_sort)).index_select(
        1, _inverse_permutation(indices_spare_sort)
    )  # [E, R]: tokens of home expert e placed on EP rank r

    num_kept = min(k, num_experts)  # a rank cannot usefully host more slots than there are experts
    pieces, home_experts = assignment.sort(dim=0, descending=True, stable=True)
    per_slot = torch.zeros(num_experts, num_ep_ranks, k, dtype=assignment.dtype, device=assignment.device)
    per_slot[:, :, :num_kept].scatter_(0, home_experts[:num_kept].T.unsqueeze(0), pieces[:num_kept].T.unsqueeze(0))
    return per_slot.view(num_experts, num_ep_ranks * k)


def gen_assignment(
    count_tokens_per_expert_from_ep_rank: Tensor,
    ep_rank: Tensor | int | None = None,
    num_ep_ranks: int | None = None,
    num_spare_experts_per_ep_rank: int = 1,
    tolerance: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """How many tokens each home expert offloads to each spare slot.

    Args: as ``gen_intermediate``, plus ``num_spare_experts_per_ep_rank`` (``k``).

    Returns:
        ``(count_tokens_from_home_expert_to_spare_expert [E, R*k],
        count_spillover_per_home_expert [E], capacity_spare_per_ep_rank [R])``.
        Column ``j`` is slot ``j % k`` of EP rank ``j // k``; each column has at
        most one non-zero entry (a slot holds one expert's weights). A home
        expert never gets a slot on its own rank (spillover needs load > avg,
        spare capacity needs load < avg). Megatron-Core's optional
        ``threshold_multiplier`` reclaim step is not in the seed and not here.
    """
    if num_spare_experts_per_ep_rank < 1:
        raise ValueError("num_spare_experts_per_ep_rank must be >= 1")
    count_spillover, capacity_spare, _ = gen_intermediate(count_tokens_per_expert_from_ep_rank, ep_rank, num_ep_ranks,
                                                          tolerance)
    assignment = _match_spillover_to_spare_slots(count_spillover, capacity_spare, num_spare_experts_per_ep_rank)
    return assignment, count_spillover, capacity_spare


def home_expert_of_spare(map_home_expert_to_spare: Tensor) -> Tensor:
    """``[E, S]`` (bool map or counts) -> ``[S]`` int64 home expert per slot, ``-1`` if unused.

    Computed as a weighted sum rather than ``argmax`` so it has no tie rule to
    depend on (each column holds at most one non-zero).
    """
    active = map_home_expert_to_spare > 0
    expert_ids = torch.arange(active.shape[0], device=active.device).unsqueeze(1)
    home = (active.long() * expert_ids).sum(dim=0)
    return torch.where(active.any(dim=0), home, -1)


def breadth_first_allocation(
    count_tokens_per_expert_from_ep_rank: Tensor,
    count_tokens_from_home_expert_to_spare_expert: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """First pass: every source EP rank sends its proportional share, rounded down.

    For spare slot ``j`` with home expert ``h`` and capacity ``c``, source rank
    ``r`` sends ``floor(count[r, h] * c / sum_r count[r, h])``. Integer arithmetic,
    not the seed's float ``probs * capacity``: same numbers, but exact, so every
    rank and device gets bit-identical floors.

    Args:
        count_tokens_per_expert_from_ep_rank: ``[R, E]`` int.
        count_tokens_from_home_expert_to_spare_expert: ``[E, S]`` int, at most one
            non-zero per column (``gen_assignment``'s output).

    Returns:
        ``(count_tokens_offloaded_to_spare [R, S],
        count_tokens_per_expert_from_ep_rank_after [R, E],
        capacity_spare_remaining [E, S])``: this pass's sends, what stays home,
        and the rounding leftovers that ``depth_first_allocation`` fills.
    """
    count_tokens = count_tokens_per_expert_from_ep_rank.long()
    assignment = count_tokens_from_home_expert_to_spare_expert.long()
    idx_supplier = home_expert_of_spare(assignment).clamp(min=0)  # unused slots: capacity 0, any row
    capacity = assignment.amax(dim=0)  # [S]

    count_tokens_rel = count_tokens.index_select(1, idx_supplier)  # [R, S]
    denominator = count_tokens_rel.sum(dim=0).clamp(min=1)  # 0 tokens => capacity 0 => floors 0
    count_tokens_floors = count_tokens_rel * capacity // denominator

    count_tokens_offloaded_from_home = torch.zeros_like(count_tokens).index_add_(1, idx_supplier, count_tokens_floors)
    count_tokens_after = count_tokens - count_tokens_offloaded_from_home
    capacity_spare_remaining = assignment.scatter_add(
        0, idx_supplier.unsqueeze(0), -count_tokens_floors.sum(dim=0, keepdim=True)
    )
    return count_tokens_floors, count_tokens_after, capacity_spare_remaining


def depth_first_allocation(
    count_tokens_per_expert_from_ep_rank: Tensor,
    capacity_spare_remaining: Tensor,
) -> tuple[Tensor, Tensor]:
    """Second pass: fill the leftover slot capacity, source EP rank 0 first.

    Per home expert ``e``, the chunks are what each source rank still holds
    for ``e`` (``count[:, e]``, in rank order) and the buckets are ``e``'s
    leftover slot capacities (``capacity[e, :]``, in slot order): one
    ``one_shot_greedy_assignment`` per expert, batched.

    Args:
        count_tokens_per_expert_from_ep_rank: ``[R, E]`` int, after the first pass.
        capacity_spare_remaining: ``[E, S]`` int.

    Returns:
        ``(count_tokens_offloaded_to_spare [R, S],
        count_tokens_per_expert_from_ep_rank_after [R, E])``.
    """
    count_tokens = count_tokens_per_expert_from_ep_rank.long()
    overlap = _interval_overlap(count_tokens.T, capacity_spare_remaining.long())  # [E, R, S]
    return overlap.sum(dim=0), count_tokens - overlap.sum(dim=2).T


# --------------------------------------------------------------------------- rerouting


def apply_offloading_plan(
    map_token_to_expert: Tensor,
    probs_routing: Tensor,
    count_tokens_offloaded_to_spare: Tensor,
    map_home_expert_to_spare: Tensor,
) -> tuple[Tensor, Tensor]:
    """Move this rank's tokens from home experts to spare slots (home | spare layout).

    Slot ``j`` (home expert ``h``) takes ``count[j]`` of this rank's tokens for
    ``h``: those whose position among ``h``'s tokens (in token order) falls in
    ``[start_j, start_j + count[j])``, where ``start_j`` adds up the counts of
    earlier slots with the same home. The windows are disjoint, so each
    (token, expert) pair ends up in exactly one column. A moved token leaves
    its home column and takes its probability to the slot column. If a count
    exceeds the tokens available, only the available ones move.

    Args:
        map_token_to_expert: ``[T, E]`` bool, this rank's routing map.
        probs_routing: ``[T, E]`` float, this rank's routing probs (autograd flows).
        count_tokens_offloaded_to_spare: ``[S]`` int, this rank's row of the
            allocation (``breadth_first + depth_first``).
        map_home_expert_to_spare: ``[E, S]`` bool.

    Returns:
        ``(map [T, E + S] bool, probs [T, E + S])``: columns ``[0, E)`` home
        experts, ``[E, E + S)`` spare slots.
    """
    moves = token_moves(map_token_to_expert, count_tokens_offloaded_to_spare, map_home_expert_to_spare)
    return moves.routing_map, reroute_probs(probs_routing, moves.moved, moves.moved_from_home, moves.home_index)


class TokenMoves(NamedTuple):
    """The integer part of a reroute: which (token, home expert) pairs go to which spare slot."""

    routing_map: Tensor       # [T, E + S] bool, home columns then spare slots
    moved: Tensor             # [T, S] bool, token t goes to slot j
    moved_from_home: Tensor   # [T, E] bool, token t leaves home expert e
    home_index: Tensor        # [S] int64, slot j's home expert (0 for unused slots, whose column is empty)


def token_moves(map_token_to_expert: Tensor, count_tokens_offloaded_to_spare: Tensor,
                map_home_expert_to_spare: Tensor) -> TokenMoves:
    """``apply_offloading_plan`` without the probabilities: integers only, no autograd, sync-free."""
    num_tokens, num_experts = map_token_to_expert.shape
    home = home_expert_of_spare(map_home_expert_to_spare)
    active = home >= 0
    home_idx = home.clamp(min=0)
    count = torch.where(active, count_tokens_offloaded_to_spare.long(), 0)  # [S]

    same_home_earlier = (home.unsqueeze(1) == home.unsqueeze(0)).tril(diagonal=-1)  # [j, j'] with j' < j
    window_start = (same_home_earlier.long() * count.unsqueeze(0)).sum(dim=1)  # [S]
    window_end = window_start + count

    routing = map_token_to_expert.bool()
    # Position of each token among its home expert's tokens. The scan runs along contiguous
    # rows ([S, T]): a cumsum over dim 0 of [T, E] takes a slow outer-dimension kernel on GPUs.
    routing_home = routing.t().index_select(0, home_idx)  # [S, T]
    position = routing_home.cumsum(dim=1, dtype=torch.int32) - 1
    moved = (routing_home & (position >= window_start.unsqueeze(1)) & (position < window_end.unsqueeze(1))).t()

    moved_from_home = torch.zeros(num_tokens, num_experts, dtype=torch.int32, device=routing.device)
    moved_from_home = moved_from_home.index_add_(1, home_idx, moved.int()) > 0  # [T, E]
    map_rerouted = torch.cat([routing & ~moved_from_home, moved], dim=1)
    return TokenMoves(map_rerouted, moved, moved_from_home, home_idx)


def reroute_probs(probs_routing: Tensor, moved: Tensor, moved_from_home: Tensor, home_index: Tensor) -> Tensor:
    """``[T, E]`` probs -> ``[T, E + S]``: a moved token's probability follows it to its slot (differentiable).

    ``moved``, ``moved_from_home``, ``home_index``: the fields of ``TokenMoves``.
    """
    zero = torch.zeros((), dtype=probs_routing.dtype, device=probs_routing.device)
    probs_home = torch.where(moved_from_home, zero, probs_routing)
    probs_spare = torch.where(moved, probs_routing.index_select(1, home_index), zero)
    return torch.cat([probs_home, probs_spare], dim=1)


def interleave_spare_slots(x: Tensor, num_ep_ranks: int, num_spare_experts_per_ep_rank: int) -> Tensor:
    """``[..., E + S]`` home | spare columns -> rank-major ``[..., E + S]``.

    Rank ``r``'s columns become contiguous: its ``E/R`` home experts, then its
    ``k`` spare slots. That is the per-rank chunking an EP token dispatcher
    expects (``num_local_experts = E/R + k``), as in Megatron-Core.
    """
    num_spare = num_ep_ranks * num_spare_experts_per_ep_rank
    num_experts = x.shape[-1] - num_spare
    lead = x.shape[:-1]
    home = x[..., :num_experts].reshape(*lead, num_ep_ranks, num_experts // num_ep_ranks)
    spare = x[..., num_experts:].reshape(*lead, num_ep_ranks, num_spare_experts_per_ep_rank)
    return torch.cat([home, spare], dim=-1).reshape(*lead, num_experts + num_spare)


def home_expert_of_column(map_home_expert_to_spare: Tensor, num_ep_ranks: int) -> Tensor:
    """``[E + S]`` int64: whose weights each rank-major column computes with (``-1``: unused slot).

    Spare column ``c`` runs a copy of home expert ``home_expert_of_column(...)[c]``; its weight
    gradient is summed back into that expert. The layer itself moves weights by slot
    (``home_expert_of_spare`` and ``spare_weights``); this per-column view is for reading a plan.
    """
    num_experts, num_spare = map_home_expert_to_spare.shape
    home_ids = torch.arange(num_experts, device=map_home_expert_to_spare.device)
    columns = torch.cat([home_ids, home_expert_of_spare(map_home_expert_to_spare)])
    return interleave_spare_slots(columns, num_ep_ranks, num_spare // num_ep_ranks)


def gen_offloading_plan(
    map_token_to_expert: Tensor,
    probs_routing: Tensor,
    count_tokens_per_expert_from_ep_rank: Tensor,
    ep_rank: Tensor | int,
    num_ep_ranks: int,
    num_spare_experts_per_ep_rank: int = 1,
    tolerance: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Plan ECHO offloading and apply it to this EP rank's routing.

    Args:
        map_token_to_expert: ``[T, E]`` bool, this rank's routing map.
        probs_routing: ``[T, E]`` float, this rank's routing probs.
        count_tokens_per_expert_from_ep_rank: ``[sources, E]`` int, all-gathered
            ``map_token_to_expert.sum(0)`` of every rank that routes tokens to these
            experts (the EP ranks; ``etp x ep`` ranks under expert tensor parallelism).
            The same on all of them.
        ep_rank: this rank's row in that matrix (int or 0-dim device tensor).
        num_ep_ranks: ``R``.
        num_spare_experts_per_ep_rank: ``k`` spare slots per EP rank.
        tolerance: imbalance left alone, as in ``gen_intermediate``.

    Returns:
        ``(rerouted_routing_map [T, E + R*k] bool, rerouted_probs [T, E + R*k],
        expert_offloading_map [E, R*k] bool)``. The routing outputs are
        rank-major (``interleave_spare_slots``); the offloading map is in slot
        order, slot ``j`` on EP rank ``j // k``. ``expert_offloading_map`` and the
        per-rank send counts depend only on the global counts, so every EP rank
        computes them identically; the rerouted map and probs are this rank's own.
    """
    plan = plan_token_moves(map_token_to_expert, count_tokens_per_expert_from_ep_rank, ep_rank, num_ep_ranks,
                            num_spare_experts_per_ep_rank, tolerance)
    probs = reroute_probs(probs_routing, plan.moves.moved, plan.moves.moved_from_home, plan.moves.home_index)
    return (
        interleave_spare_slots(plan.moves.routing_map, num_ep_ranks, num_spare_experts_per_ep_rank),
        interleave_spare_slots(probs, num_ep_ranks, num_spare_experts_per_ep_rank),
        plan.expert_offloading_map,
    )


class OffloadingPlan(NamedTuple):
    moves: TokenMoves                 # this rank's token moves (home | spare column order)
    expert_offloading_map: Tensor     # [E, S] bool, the same on every rank


def plan_token_moves(
    map_token_to_expert: Tensor,
    count_tokens_per_expert_from_ep_rank: Tensor,
    ep_rank: Tensor | int,
    num_ep_ranks: int,
    num_spare_experts_per_ep_rank: int = 1,
    tolerance: float = 0.0,
) -> OffloadingPlan:
    """Everything of ``gen_offloading_plan`` but the probabilities: integer tensors in and out,
    no autograd and no host sync, so it can be replayed from one CUDA graph."""
    count_tokens_from_home_expert_to_spare_expert, _, _ = gen_assignment(
        count_tokens_per_expert_from_ep_rank, ep_rank, num_ep_ranks, num_spare_experts_per_ep_rank, tolerance
    )
    expert_offloading_map = count_tokens_from_home_expert_to_spare_expert > 0

    first_pass, count_after_first, capacity_remaining = breadth_first_allocation(
        count_tokens_per_expert_from_ep_rank, count_tokens_from_home_expert_to_spare_expert
    )
    second_pass, _ = depth_first_allocation(count_after_first, capacity_remaining)
    count_tokens_offloaded_to_spare = _select_row(first_pass + second_pass, ep_rank)
    moves = token_moves(map_token_to_expert, count_tokens_offloaded_to_spare, expert_offloading_map)
    return OffloadingPlan(moves, expert_offloading_map)
