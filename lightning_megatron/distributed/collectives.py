"""Flat-tensor reduce-scatter and all-gather under the names of every supported torch version.

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to ``*_single`` (the old
names warn); the GPU machines run torch 2.11, which has only the old names.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                   async_op: bool = False) -> Any:
    """Sum ``input`` (group size × ``output`` elements) over the group; rank r keeps chunk r."""
    return _REDUCE_SCATTER(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` into ``output`` in group-rank order."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)
