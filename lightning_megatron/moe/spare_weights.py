"""ECHO's expert-weight dispatch: copy home experts into spare slots, return their gradients.

After ``gen_offloading_plan`` every EP rank knows, for each of the ``S = R·k`` spare slots in
the EP group, which home expert it runs (``-1``: unused). Slot ``j`` lives on EP rank
``j // k``; expert ``e`` lives on EP rank ``e // E_local``.

The copy is one all-to-all with *static* splits, so it needs no host sync and can be captured
in a CUDA graph: every rank sends every rank ``k`` weight blocks, one per slot of the receiver,
holding its own expert's weights where it is the slot's home rank and zeros elsewhere; the
receiver sums the ``R`` blocks of each slot (one non-zero block plus zeros is exact). The
price of static shapes is ``R·k`` blocks sent per rank where ``k`` carry data.

The gradient return is the reverse all-to-all: each slot's weight gradient goes back to every
rank, the mask keeps it only on the home rank, and it is added into the home expert's gradient,
next to the gradient of the tokens the home expert computed itself. All weights of a layer
(``weight1``, ``weight2``) travel in one all-to-all each way, and the backward writes each home
gradient once (a hand-written autograd function: autograd's own would materialize a zero
gradient per weight and add it). Expert tensor parallelism needs nothing extra: the exchange runs inside
one etp slice (the ep group), so slot copies carry the same slice as their home.

Where the slots' homes are known on the host (the all-to-all dispatcher reads them at its one host sync), the
exchange sends only the blocks that carry data: each used slot's weights from its home rank alone, and its
gradient back to that rank alone (``R`` times fewer bytes at ``R`` EP ranks, and none for unused slots).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import _a2a, group_rank, group_size


def _slot_sources(spare_homes: Tensor, num_local: int, rank: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """``(mine [S] bool, local_index [S])``: slots this rank is the home of, and which local expert."""
    homes = spare_homes.to(device=device, dtype=torch.long)
    mine = (homes >= 0) & (homes.clamp(min=0) // num_local == rank)
    return mine, homes.clamp(min=0) % num_local


class _WithSpareSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spare_homes: Tensor, group: Optional[dist.ProcessGroup], k: int, *weights: Tensor):
        num_ranks, rank = group_size(group), group_rank(group)
        num_local = weights[0].shape[0]
        mine, local_index = _slot_sources(spare_homes, num_local, rank, weights[0].device)
        blocks = torch.cat([torch.where(mine.view((-1,) + (1,) * (w.dim() - 1)), w.index_select(0, local_index),
                                        w.new_zeros(())).flatten(1) for w in weights], dim=1)     # [S, n]
        if num_ranks > 1:
            assert group is not None   # group_size(None) is 1
            blocks = _a2a(blocks, group, [k] * num_ranks, [k] * num_ranks)     # k blocks to/from every rank
        spare = blocks.view(num_ranks, k, -1).sum(dim=0)                         # one block non-zero per slot
        sizes = [w[0].numel() for w in weights]
        ctx.save_for_backward(mine, local_index)
        ctx.group, ctx.k, ctx.num_ranks, ctx.sizes = group, k, num_ranks, sizes
        return tuple(torch.cat([w, part.view((k,) + tuple(w.shape[1:]))])
                     for w, part in zip(weights, spare.split(sizes, dim=1)))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        mine, local_index = ctx.saved_tensors
        k, num_ranks = ctx.k, ctx.num_ranks
        num_local = grads[0].shape[0] - k
        spare = torch.cat([g[num_local:].reshape(k, -1) for g in grads], dim=1)   # [k, n] this rank's slots
        back = spare.unsqueeze(0).expand(num_ranks, -1, -1).reshape(num_ranks * k, -1)
        if num_ranks > 1:
            back = _a2a(back, ctx.group, [k] * num_ranks, [k] * num_ranks)      # [S, n] grads of what I sent
        back = torch.where(mine.unsqueeze(1), back, back.new_zeros(()))
        out = []
        for g, part in zip(grads, back.split(ctx.sizes, dim=1)):
            home = g[:num_local].clone()
            out.append(home.index_add_(0, local_index, part.view((-1,) + tuple(g.shape[1:]))))
        return (None, None, None, *out)


def _exact_routes(homes: Sequence[int], num_local: int, k: int, num_ranks: int, rank: int
                  ) -> Tuple[List[int], List[int], List[int], List[int]]:
    """``(send_local, send_counts, recv_slots, recv_counts)``: the local expert copied into each used slot this rank
    is the home of, in destination-rank then slot order, with counts per destination; this rank's own used slots
    (positions in ``[0, k)``) in source-rank then slot order, with counts per source. The gradients go back the same
    routes reversed, so they arrive in ``send_local``'s order."""
    send_local, send_counts = [], []
    for dst in range(num_ranks):
        mine = [homes[s] % num_local for s in range(dst * k, (dst + 1) * k)
                if homes[s] >= 0 and homes[s] // num_local == rank]
        send_local += mine
        send_counts.append(len(mine))
    recv_slots, recv_counts = [], []
    own = range(rank * k, (rank + 1) * k)
    for src in range(num_ranks):
        slots = [s - rank * k for s in own if homes[s] >= 0 and homes[s] // num_local == src]
        recv_slots += slots
        recv_counts.append(len(slots))
    return send_local, send_counts, recv_slots, recv_counts


def _to_device(values: List[int], device: torch.device) -> Tensor:
    """A host list of indices on ``device`` without making the host wait (pinned memory, asynchronous copy: a copy
    from pageable memory would block the host behind the GPU's queue, once per layer and micro-batch)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _WithUsedSpareSlots(torch.autograd.Function):
    """The exchange with host-known homes: only used slots' weights and gradients travel, each to/from its home."""

    @staticmethod
    def forward(ctx, homes: Tuple[int, ...], group: Optional[dist.ProcessGroup], k: int, *weights: Tensor):
        num_ranks, rank = group_size(group), group_rank(group)
        num_local = weights[0].shape[0]
        send_local, send_counts, recv_slots, recv_counts = _exact_routes(homes, num_local, k, num_ranks, rank)
        device = weights[0].device
        index = _to_device(send_local, device)
        blocks = torch.cat([w.index_select(0, index).flatten(1) for w in weights], dim=1)   # [sent, n]
        if num_ranks > 1:
            assert group is not None   # group_size(None) is 1
            blocks = _a2a(blocks, group, recv_counts, send_counts)
        spare = blocks.new_zeros((k, blocks.shape[1]))
        positions = _to_device(recv_slots, device)
        spare.index_copy_(0, positions, blocks)
        sizes = [w[0].numel() for w in weights]
        ctx.save_for_backward(index, positions)
        ctx.group, ctx.k, ctx.num_ranks, ctx.sizes = group, k, num_ranks, sizes
        ctx.counts = (send_counts, recv_counts)
        return tuple(torch.cat([w, part.view((k,) + tuple(w.shape[1:]))])
                     for w, part in zip(weights, spare.split(sizes, dim=1)))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        index, positions = ctx.saved_tensors
        k = ctx.k
        num_local = grads[0].shape[0] - k
        spare = torch.cat([g[num_local:].reshape(k, -1) for g in grads], dim=1)    # [k, n] this rank's slots
        back = spare.index_select(0, positions)                                     # used ones, source-rank order
        if ctx.num_ranks > 1:
            send_counts, recv_counts = ctx.counts
            back = _a2a(back, ctx.group, send_counts, recv_counts)                  # [sent, n] as they left
        out = []
        for g, part in zip(grads, back.split(ctx.sizes, dim=1)):
            home = g[:num_local].clone()
            out.append(home.index_add_(0, index, part.reshape((-1,) + tuple(g.shape[1:]))))
        return (None, None, None, *out)


def weights_with_spare_slots(weights: Sequence[Tensor], spare_homes: Tensor, group: Optional[dist.ProcessGroup],
                             num_spare_experts_per_ep_rank: int,
                             homes_on_host: Optional[Sequence[int]] = None) -> Tuple[Tensor, ...]:
    """Each weight extended by this rank's ``k`` spare slots, copied from their home experts' ranks.

    Args:
        weights: ``[E_local, ...]`` tensors of this rank's home experts (parameters; gradients
            flow back, spare-slot gradients included).
        spare_homes: ``[R·k]`` int64 global home expert of every spare slot of the EP group, in
            slot order, ``-1`` for unused slots; identical on every EP rank.
        group: the expert-parallel group (``None``: a single EP rank).
        num_spare_experts_per_ep_rank: ``k``.
        homes_on_host: ``spare_homes`` as a host list, where known (no sync made for it): then only the used
            slots' blocks travel (see the module); the same result.

    Returns:
        ``[E_local + k, ...]`` per weight: the home experts, then slot ``s`` of this rank holding
        its home expert's weights (zeros if unused).
    """
    num_ranks, k = group_size(group), num_spare_experts_per_ep_rank
    if spare_homes.shape != (num_ranks * k,):
        raise ValueError(f"spare_homes must have num_ep_ranks * num_spare_experts_per_ep_rank = {num_ranks * k} "
                         f"entries, got shape {tuple(spare_homes.shape)}.")
    if len({w.shape[0] for w in weights}) != 1:
        raise ValueError(f"every weight must hold the same number of local experts, got {[w.shape for w in weights]}.")
    if homes_on_host is not None:
        if len(homes_on_host) != num_ranks * k:
            raise ValueError(f"homes_on_host must list spare_homes' {num_ranks * k} entries, got {len(homes_on_host)}.")
        return _WithUsedSpareSlots.apply(tuple(int(h) for h in homes_on_host), group, k, *weights)
    return _WithSpareSlots.apply(spare_homes, group, k, *weights)
