"""Token dispatchers: move routed tokens to the ranks holding their experts and back.

One micro-batch goes through the phases of seed 003, each a separate call so a CUDA graph can
stop after the router or after ``preprocess`` (everything up to there is device-only work with
static shapes):

``preprocess(hidden, probs, routing_map)``  local permutation by expert + token-count exchange
``dispatch(rows, row_probs)``                token communication; returns the experts' input
``combine(expert_output)``                   the reverse communication + weighted un-permutation

What ``combine`` needs is kept in :class:`DispatchMetadata` (``self.meta``), whose tensors can
be returned from a captured graph and loaded back (``tensors()`` / ``load_tensors()``).

Host syncs: none when dropless on a single expert rank (``T·k`` rows) or with pad-to-capacity
(every split size is static). Dropless routing over several expert ranks needs the split sizes
on the host: one device→host copy in ``dispatch`` (the all-gather dispatcher: the local row
count). Dropping without padding needs the kept-row count: one copy in ``preprocess``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..tensor_parallel.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from ..tensor_parallel.utils import divide
from .comm import all_gather_stack, all_to_all, gather_rows, group_rank, group_size, reduce_scatter_rows
from .groups import MoEGroups
from .permute import (
    chunk_sort_index, gather_permutation, inverse_permutation, permute_indexed, permute_per_token, permute_probs,
    unpermute, unpermute_per_token,
)

DISPATCHERS = ("alltoall", "allgather")


@dataclasses.dataclass
class DispatchMetadata:
    """One micro-batch's routing bookkeeping: what ``combine`` needs to undo the dispatch.

    Integers are static for a given input shape; tensors stay on the device.
    """

    TENSOR_FIELDS = ("routing_map", "slots", "counts", "tokens_per_expert", "sort_index", "spare_homes",
                     "token_order", "token_rows")

    num_tokens: int = 0                       # tokens routed on this rank
    num_out: int = 0                          # rows permuted on this rank
    capacity: Optional[int] = None            # per-expert capacity when padded (static splits)
    dropless: bool = True
    dtype: Optional[torch.dtype] = None       # dtype of the layer's tokens (combine returns it)
    rows_per_expert: Optional[int] = None     # padded: rows every local expert receives
    routing_map: Optional[Tensor] = None      # [T, E] bool
    slots: Optional[Tensor] = None            # [num_out] slot e·T+t of each permuted row
    counts: Optional[Tensor] = None           # all-to-all: [etp, ep, E] tokens sent by rank to expert
    tokens_per_expert: Optional[Tensor] = None  # [E_local] rows per local expert after dispatch
    sort_index: Optional[Tensor] = None       # received rows -> expert-major order
    splits: Optional[Dict[str, List[int]]] = None  # host row counts of the collectives
    spare_homes: Optional[Tensor] = None      # ECHO: [ep·k] home expert of each spare slot (-1 unused)
    spare_slots_used: Optional[bool] = None   # ECHO: whether any slot is used, read at dispatch (None: not read)
    spare_homes_host: Optional[List[int]] = None  # ECHO: spare_homes as read at dispatch (None: not read)
    rows_per_ep_rank: Optional[List[int]] = None  # rows each EP rank receives, read at dispatch (report_loads)
    token_order: Optional[Tensor] = None      # dropless top-k: the T·k rows listed token by token
    token_rows: Optional[Tensor] = None       # permute kernels: [T, E] each token's rows, -1 after the last

    def tensors(self) -> Dict[str, Tensor]:
        """The tensor fields that are set (what a partial CUDA graph must output)."""
        return {f: getattr(self, f) for f in self.TENSOR_FIELDS if isinstance(getattr(self, f), Tensor)}

    def load_tensors(self, tensors: Dict[str, Tensor]) -> None:
        """Restore tensor fields (e.g. a graph replay's outputs) saved by :meth:`tensors`."""
        for name, value in tensors.items():
            if name not in self.TENSOR_FIELDS:
                raise KeyError(f"{name!r} is not a DispatchMetadata tensor field {self.TENSOR_FIELDS}.")
            setattr(self, name, value)


class TokenDispatcher(abc.ABC):
    """Shared setup: expert placement (global expert ``e`` lives on ep rank ``e // E_local``)."""

    def __init__(self, num_experts: int, topk: int, groups: Optional[MoEGroups] = None) -> None:
        self._explicit_groups = groups
        g = self.groups
        self.num_experts, self.topk = num_experts, topk
        self.ep_size, self.ep_rank = group_size(g.ep), group_rank(g.ep)
        self.etp_size, self.etp_rank = group_size(g.etp), group_rank(g.etp)
        self.num_local_experts = divide(num_experts, self.ep_size, "num_experts",
                                        by="expert-parallel size (ep)")
        self.local_experts = slice(self.ep_rank * self.num_local_experts,
                                   (self.ep_rank + 1) * self.num_local_experts)
        self.meta = DispatchMetadata()
        self._row_probs: Optional[Tensor] = None

    @property
    def groups(self) -> MoEGroups:
        return MoEGroups.resolve(self._explicit_groups)

    def _num_routed(self, routing_map: Tensor, num_tokens: int, capacity: Optional[int], dropless: bool,
                    columns: int, sources: int) -> int:
        """Rows a permutation of ``routing_map`` yields, from static facts when they suffice."""
        if capacity is not None:
            return columns * capacity * sources
        if dropless and columns == self.num_experts:
            return num_tokens * self.topk
        return int(routing_map.sum())   # data-dependent: a host sync

    @abc.abstractmethod
    def preprocess(self, hidden: Tensor, probs: Tensor, routing_map: Tensor, *, capacity: Optional[int] = None,
                   dropless: bool = True) -> Tuple[Tensor, Tensor]:
        """Permute this rank's tokens into per-expert rows (the metadata goes to ``self.meta``)."""

    @abc.abstractmethod
    def dispatch(self, hidden: Tensor, probs: Tensor) -> Tuple[Tensor, Tensor]:
        """Send the rows to the ranks holding their experts; return them and per-expert counts."""

    @abc.abstractmethod
    def combine(self, expert_output: Tensor) -> Tensor:
        """Bring expert outputs back to their tokens' rank, weighted by the routing probabilities."""


class AllToAllTokenDispatcher(TokenDispatcher):
    """Each rank permutes its own tokens, sends each expert rank its rows (all-to-all over ep),
    then the etp ranks of one expert rank share their rows (all-gather over etp), since each
    holds a slice of every local expert. Combine reverses: reduce-scatter over etp sums the
    partial expert outputs, all-to-all back, weighted sum into the tokens.

    ``report_loads``: the dropless dispatch also reads, in its one host sync, the rows every EP rank receives
    (``meta.rows_per_ep_rank``, the same on every rank of the expert group): ECHO's schedule watches them."""

    def __init__(self, num_experts: int, topk: int, groups: Optional[MoEGroups] = None,
                 report_loads: bool = False) -> None:
        super().__init__(num_experts, topk, groups)
        self.report_loads = report_loads

    def preprocess(self, hidden: Tensor, probs: Tensor, routing_map: Tensor, *, capacity: Optional[int] = None,
                   dropless: bool = True) -> Tuple[Tensor, Tensor]:
        num_tokens = hidden.shape[0]
        num_out = self._num_routed(routing_map, num_tokens, capacity, dropless, self.num_experts, 1)
        token_order = token_rows = None
        if capacity is None and dropless and num_out == num_tokens * self.topk:   # exactly k rows per token
            rows, slots, token_order = permute_per_token(hidden, routing_map, self.topk)
        else:
            rows, slots, token_rows = permute_indexed(hidden, routing_map, num_out)
        meta = DispatchMetadata(num_tokens=num_tokens, num_out=num_out, capacity=capacity, dropless=dropless,
                                dtype=hidden.dtype, routing_map=routing_map, slots=slots, token_order=token_order,
                                token_rows=token_rows)
        sources = self.ep_size * self.etp_size
        if capacity is not None:
            meta.rows_per_expert = sources * capacity
            meta.tokens_per_expert = torch.full((self.num_local_experts,), sources * capacity,
                                                dtype=torch.long, device=hidden.device)
        else:
            local = routing_map.sum(dim=0)                                          # [E]
            counts = all_gather_stack(all_gather_stack(local, self.groups.ep), self.groups.etp)
            meta.counts = counts                                                    # [etp, ep, E]
            meta.tokens_per_expert = counts[:, :, self.local_experts].sum(dim=(0, 1))
        self.meta = meta
        return rows, permute_probs(probs, slots)

    def _splits(self) -> Dict[str, List[int]]:
        m, ep, etp, n_local = self.meta, self.ep_size, self.etp_size, self.num_local_experts
        if m.capacity is not None:
            per_rank = n_local * m.capacity
            return {"send": [per_rank] * ep, "recv": [per_rank] * ep, "gathered": [ep * per_rank] * etp}
        assert m.counts is not None   # dropless: preprocess gathered the counts
        rows = m.counts.view(etp, ep, ep, n_local).sum(dim=-1)      # [etp q, ep src j, ep dst p]
        q, p = self.etp_rank, self.ep_rank
        parts = [rows[q, p], rows[q, :, p], rows[:, :, p].sum(dim=1)]
        if m.spare_homes is not None:   # ECHO: which spare slots copy which expert, read in the same sync
            parts.append(m.spare_homes.to(rows.dtype))
        if self.report_loads:
            parts.append(rows.sum(dim=(0, 1)))                        # [ep dst p]: every source's rows to p
        host = torch.cat(parts).tolist()  # the one sync
        if self.report_loads:
            m.rows_per_ep_rank, host = host[-ep:], host[:-ep]
        if m.spare_homes is not None:
            slots = m.spare_homes.numel()
            m.spare_homes_host, host = host[-slots:], host[:-slots]
            m.spare_slots_used = max(m.spare_homes_host) >= 0
        return {"send": host[:ep], "recv": host[ep:2 * ep], "gathered": host[2 * ep:]}

    def dispatch(self, hidden: Tensor, probs: Tensor) -> Tuple[Tensor, Tensor]:
        m = self.meta
        assert m.tokens_per_expert is not None   # set by preprocess
        self._row_probs = probs
        if self.ep_size * self.etp_size == 1:
            return hidden, m.tokens_per_expert
        g = self.groups
        m.splits = self._splits()
        x = all_to_all(hidden, g.ep, m.splits["recv"], m.splits["send"])
        x = gather_rows(x, g.etp, m.splits["gathered"])                 # chunks (etp q, ep j, expert i)
        sources = self.ep_size * self.etp_size
        if m.capacity is not None:
            x = x.view(sources, self.num_local_experts, m.capacity, -1).transpose(0, 1).reshape(x.shape)
        else:
            assert m.counts is not None   # dropless: preprocess gathered the counts
            chunks = m.counts[:, :, self.local_experts].reshape(sources, self.num_local_experts)
            m.sort_index = chunk_sort_index(chunks, sum(m.splits["gathered"]))
            x = gather_permutation(x, m.sort_index)
        return x, m.tokens_per_expert

    def combine(self, expert_output: Tensor) -> Tensor:
        m, y = self.meta, expert_output
        if self.ep_size * self.etp_size > 1:
            assert m.splits is not None   # set by dispatch
            g = self.groups
            sources = self.ep_size * self.etp_size
            if m.capacity is not None:
                y = y.view(self.num_local_experts, sources, m.capacity, -1).transpose(0, 1).reshape(y.shape)
            else:
                assert m.sort_index is not None   # set by dispatch (dropless)
                y = gather_permutation(y, inverse_permutation(m.sort_index), m.sort_index)
            y = reduce_scatter_rows(y, g.etp, m.splits["gathered"])
            y = all_to_all(y, g.ep, m.splits["send"], m.splits["recv"])
        if m.token_order is not None:
            out = unpermute_per_token(y, m.token_order, m.num_tokens, self._row_probs, out_dtype=m.dtype)
        else:
            assert m.slots is not None   # set by preprocess
            out = unpermute(y, m.slots, m.num_tokens, self._row_probs, out_dtype=m.dtype, token_rows=m.token_rows)
        self._row_probs = None
        return out


class AllGatherTokenDispatcher(TokenDispatcher):
    """Every rank of the expert model-parallel group (tp-ep) gathers all the group's tokens and
    computes the rows for its own experts (its etp slice of them); combine sums every rank's
    partial outputs with one reduce-scatter, which also returns each rank its own tokens."""

    def preprocess(self, hidden: Tensor, probs: Tensor, routing_map: Tensor, *, capacity: Optional[int] = None,
                   dropless: bool = True) -> Tuple[Tensor, Tensor]:
        self.meta = DispatchMetadata(num_tokens=hidden.shape[0], capacity=capacity, dropless=dropless,
                                     dtype=hidden.dtype, routing_map=routing_map)
        return hidden, probs

    def dispatch(self, hidden: Tensor, probs: Tensor) -> Tuple[Tensor, Tensor]:
        m, group = self.meta, self.groups.tp_ep
        sources = group_size(group)
        routing_map = m.routing_map
        assert routing_map is not None   # set by preprocess
        if sources > 1:
            hidden = gather_from_sequence_parallel_region(hidden, group, tensor_parallel_output_grad=True)
            probs = gather_from_sequence_parallel_region(probs, group, tensor_parallel_output_grad=True)
            routing_map = all_gather_stack(routing_map.to(torch.uint8), group).view(-1, self.num_experts).bool()
        local_map = routing_map[:, self.local_experts]
        m.num_out = self._num_routed(local_map, hidden.shape[0], m.capacity, m.dropless,
                                     self.num_local_experts, sources)
        rows, m.slots, m.token_rows = permute_indexed(hidden, local_map, m.num_out)
        self._row_probs = permute_probs(probs[:, self.local_experts], m.slots)
        if m.capacity is not None:
            m.rows_per_expert = sources * m.capacity
            m.tokens_per_expert = torch.full((self.num_local_experts,), m.rows_per_expert, dtype=torch.long,
                                             device=hidden.device)
        else:
            m.tokens_per_expert = local_map.sum(dim=0)
        return rows, m.tokens_per_expert

    def combine(self, expert_output: Tensor) -> Tensor:
        m, group = self.meta, self.groups.tp_ep
        num_gathered = m.num_tokens * group_size(group)
        assert m.slots is not None   # set by dispatch
        out = unpermute(expert_output, m.slots, num_gathered, self._row_probs, out_dtype=m.dtype,
                        token_rows=m.token_rows)
        self._row_probs = None
        if group_size(group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, group)
        return out


def build_dispatcher(kind: str, num_experts: int, topk: int, groups: Optional[MoEGroups] = None,
                     report_loads: bool = False) -> TokenDispatcher:
    """``report_loads``: the all-to-all dispatcher's (the all-gather dispatcher has no per-rank sync to read
    them in, and reports none)."""
    if kind == "alltoall":
        return AllToAllTokenDispatcher(num_experts, topk, groups, report_loads=report_loads)
    if kind == "allgather":
        return AllGatherTokenDispatcher(num_experts, topk, groups)
    raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {kind!r}.")
