"""One contiguous gradient buffer per (reduction group, dtype), cut into buckets reduced as one.

Parameters are laid out in backward order (the reverse of registration order, Megatron's
heuristic: the last layers' gradients are ready first), so the first bucket fills first and its
reduction can start while the backward still runs through earlier layers. A bucket closes once
it holds ``bucket_size`` elements, at a parameter boundary; a parameter marked ``isolate`` gets a
bucket of its own and is never reduced early (the tied embedding, which must first be summed
across pipeline stages). With ``shard=True`` (distributed optimizer) every bucket is padded to a
multiple of ``group size × SHARD_ALIGN`` and reduce-scattered: group rank r then holds the
reduced chunk r of each bucket, the range its optimizer shard owns.

Each parameter's ``main_grad`` is a view of its range; the reduction divides by ``divisor``
(the dp·cp size, see ``finalize.py``) after summing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .collectives import reduce_scatter

SHARD_ALIGN = 64   # elements: each rank's chunk of a bucket starts 256 B aligned in fp32


@dataclass(frozen=True)
class BucketSpec:
    """Where one bucket lies in the buffer and which parameters (by index) it holds."""

    start: int
    end: int                       # padded end: ``end - start`` divides by the padding unit
    params: Tuple[int, ...]
    isolated: bool = False


def bucket_layout(numels: Sequence[int], bucket_size: Optional[int], pad_to: int = 1,
                  isolate: Sequence[bool] = ()) -> Tuple[List[Tuple[int, int]], List[BucketSpec], int]:
    """Pure layout: ``(param ranges, buckets, total elements)`` for parameters given in buffer order.

    ``bucket_size=None`` puts everything (except isolated parameters) in one bucket.
    """
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements or None, got {bucket_size!r}.")
    ranges: List[Tuple[int, int]] = []
    buckets: List[BucketSpec] = []
    members: List[int] = []
    offset = bucket_start = 0

    def close(isolated: bool = False) -> None:
        nonlocal offset, bucket_start
        if not members:
            return
        end = -(-offset // pad_to) * pad_to
        buckets.append(BucketSpec(bucket_start, end, tuple(members), isolated))
        members.clear()
        offset = bucket_start = end

    for index, numel in enumerate(numels):
        alone = bool(isolate[index]) if index < len(isolate) else False
        if alone:
            close()
        ranges.append((offset, offset + numel))
        members.append(index)
        offset += numel
        if alone or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close(alone)
    close()
    return ranges, buckets, offset


@dataclass(eq=False)
class Bucket:
    """A bucket at run time: its parameters, which of them are ready, its reduction in flight."""

    index: int
    start: int
    end: int
    params: List[nn.Parameter]
    isolated: bool
    ready: Set[int] = field(default_factory=set)   # id() of params whose last gradient arrived
    handle: Any = None                              # async work of the reduction in flight
    started: bool = False


class GradBuffer:
    """The gradients of ``params`` (given in backward order) in one flat tensor of ``dtype``."""

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype, group: Optional[dist.ProcessGroup],
                 divisor: int, bucket_size: Optional[int] = None, shard: bool = False,
                 isolate: Sequence[bool] = ()) -> None:
        if not params:
            raise ValueError("GradBuffer needs at least one parameter.")
        self.params = list(params)
        self.dtype, self.group, self.divisor, self.shard = dtype, group, divisor, shard
        self.group_size = dist.get_world_size(group) if group is not None else 1
        self.group_rank = dist.get_rank(group) if group is not None else 0
        pad_to = self.group_size * SHARD_ALIGN if shard and self.group_size > 1 else 1
        ranges, specs, total = bucket_layout([p.numel() for p in self.params], bucket_size, pad_to, isolate)
        self.numel = total
        self.data = torch.zeros(total, dtype=dtype, device=self.params[0].device)
        self.ranges: Dict[int, Tuple[int, int]] = {}
        for param, (start, end) in zip(self.params, ranges):
            self.ranges[id(param)] = (start, end)
            param.main_grad = self.data[start:end].view_as(param)  # type: ignore[attr-defined]  # runtime attribute
        self.buckets = [Bucket(i, s.start, s.end, [self.params[j] for j in s.params], s.isolated)
                        for i, s in enumerate(specs)]
        self.bucket_of: Dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}

    # -- layout ------------------------------------------------------------------------------------
    def shard_range(self, bucket: Bucket, rank: Optional[int] = None) -> Tuple[int, int]:
        """Buffer range of group rank ``rank``'s chunk of ``bucket`` (the whole bucket unsharded)."""
        if not self.shard:
            return bucket.start, bucket.end
        rank = self.group_rank if rank is None else rank
        size = (bucket.end - bucket.start) // self.group_size
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def signature(self) -> Tuple[Any, ...]:
        """Layout as integers: equal on two ranks iff their buffers line up element for element."""
        return (self.numel, tuple((b.start, b.end) for b in self.buckets),
                tuple(self.ranges[id(p)] for p in self.params))

    # -- reduction ---------------------------------------------------------------------------------
    def start(self, bucket: Bucket) -> None:
        """Issue the bucket's reduction (async); a no-op for a group of one."""
        if bucket.started:
            return
        bucket.started = True
        if self.group_size == 1:
            return
        view = self.data[bucket.start:bucket.end]
        if self.shard:
            lo, hi = self.shard_range(bucket)
            bucket.handle = reduce_scatter(self.data[lo:hi], view, group=self.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(view, group=self.group, async_op=True)

    def wait(self, bucket: Bucket) -> None:
        """Finish the bucket's reduction and turn the sum into the mean over ``divisor``."""
        self.start(bucket)
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        if self.divisor != 1:
            lo, hi = self.shard_range(bucket)
            self.data[lo:hi].div_(self.divisor)

    def reset(self) -> None:
        """Ready for the next step's reduction (gradients kept)."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                raise RuntimeError(f"bucket {bucket.index} still has a reduction in flight; call "
                                   "finish_grad_sync() before starting the next step.")
            bucket.ready.clear()
            bucket.started = False

    def zero_(self) -> None:
        self.reset()
        self.data.zero_()
