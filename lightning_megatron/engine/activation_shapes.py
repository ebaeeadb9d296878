"""The shape of the activations pipeline stages exchange, learned once per micro-batch shape.

Without a known shape every send goes with a header that the receiver reads on the host (``tolist``) before it can
post the receive: a host synchronisation per exchange, a dozen or more per step, each leaving the GPU idle while the
host launches the next micro-batch's work (on GPUs the 1F1B step stayed 6-14% above its ideal with a balanced split).
Megatron-Core asks the user for the shape (``seq_length``, ``micro_batch_size``, ``variable_seq_lengths``); here a
step with headers shows it: when every activation every stage sent or received in that step had one shape, and every
stage agrees on it (one small all-gather over the pipeline group, in that step only), later steps whose micro-batches
have the same shapes and dtypes exchange without headers. Micro-batches of another shape (a ragged last batch,
validation at another length) exchange with headers and are learned in turn. A full-step CUDA graph uses the
shape its eager warm-up learned (nothing may be read on the host inside the graph).

Stages whose output shape depends on the values in a micro-batch, not only on its shape, must keep the headers:
``LIGHTNING_MEGATRON_PIPELINE_SHAPES=exchange`` (the default is ``learn``); a learned shape that a later send does
not match raises an error naming this setting.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

ENV = "LIGHTNING_MEGATRON_PIPELINE_SHAPES"
MAX_NDIM = 8

Signature = Tuple[Any, ...]
Shape = Tuple[int, ...]


def learning_enabled() -> bool:
    """``LIGHTNING_MEGATRON_PIPELINE_SHAPES``: ``learn`` (default) or ``exchange`` (headers at every exchange)."""
    value = os.environ.get(ENV, "learn").strip().lower()
    if value not in ("learn", "exchange"):
        raise ValueError(f"{ENV}={value!r}: use 'learn' (the default: activation shapes learned once per "
                         "micro-batch shape) or 'exchange' (every exchange sends its shape ahead).")
    return value == "learn"


def signature(microbatches: Sequence[Any]) -> Signature:
    """What the activations' shapes may depend on: the micro-batches' structure (one, cut from one batch) and every
    micro-batch's tensors' shapes and dtypes, in order."""
    if not microbatches:
        return ()
    spec = str(tree_flatten(microbatches[0])[1])
    return (spec,) + tuple(tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                                 for t in tree_flatten(microbatch)[0]) for microbatch in microbatches)


def one_shape(shapes: Sequence[Shape]) -> Optional[Shape]:
    """The shape every one of ``shapes`` has, or ``None`` (none recorded, or more than one)."""
    distinct = set(shapes)
    return next(iter(distinct)) if len(distinct) == 1 else None


class ActivationShapes:
    """Learned shapes by micro-batch signature (identical on every rank of a pipeline group: they agree on it)."""

    def __init__(self) -> None:
        self._learned: Dict[Signature, Shape] = {}

    def known(self, key: Signature) -> Optional[Shape]:
        return self._learned.get(key)

    def learn(self, key: Signature, shapes: List[Shape], group: dist.ProcessGroup, device: torch.device) -> None:
        """Record ``key``'s shape if every stage of ``group`` saw exactly one and the same (collective over
        ``group``, every rank with its own ``shapes``: what it received and sent in the step)."""
        mine = one_shape(shapes)
        row = torch.full((MAX_NDIM + 1,), -1, dtype=torch.int64)
        if mine is not None and len(mine) <= MAX_NDIM:
            row[0] = len(mine)
            row[1:1 + len(mine)] = torch.tensor(mine, dtype=torch.int64)
        row = row.to(device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, row, group=group)
        everyone = torch.stack(rows).tolist()
        first = everyone[0]
        if first[0] >= 0 and all(r == first for r in everyone):
            self._learned[key] = tuple(first[1:1 + first[0]])
