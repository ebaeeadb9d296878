"""The tensor entries of one background save kept for the next, while the same tensors back them.

Collecting a save's entries walks every module (global names, placements) and optimizer state in Python: GPT-1.3B's
1168 entries took ~10 ms of each save call, the largest part of the call, paid while the GPU waits. A fingerprint of
what the entries are made from (this rank's parallel positions; every parameter, persistent buffer and optimizer-state
tensor: its identity, storage address, shape, stride and dtype; the optimizers and the state keys) costs ~1 ms and is
taken at every save: while it is the same, the cached entries are exactly what collecting again would give (they
hold those storages, so no other tensor can take their addresses and be mistaken for them). Anything swapped, added,
moved, re-sharded or re-created (a reloaded optimizer, ``param.data = ...``) changes it and the entries are collected
again. The distributed optimizer's gathered views are new tensors at every save: always collected.
"""

from __future__ import annotations

from typing import Any, Hashable, List, Optional, Tuple

import torch

from ..models.sharding import persistent_buffers
from .entries import Entry, Modules, as_list, current_ranks
from .optimizer import ParamIndex
from .sharded import Optimizers, collect_tensors


def _tensor(tensor: torch.Tensor) -> Tuple[Any, ...]:
    return id(tensor), tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


def fingerprint(model_modules: Modules, optimizers: Optimizers = None) -> Hashable:
    """What ``collect_tensors(model_modules, optimizers)`` depends on, cheaply (equal only if it would be equal)."""
    parts: List[Any] = [current_ranks()]
    for module in as_list(model_modules):
        parts.append(tuple((name, _tensor(param)) for name, param in module.named_parameters()))
        parts.append(tuple((name, _tensor(buffer)) for name, buffer in persistent_buffers(module)))
    for optimizer in as_list(optimizers):
        state = optimizer.state
        parts.append((id(optimizer), tuple(
            (id(param), tuple((key, _tensor(value) if isinstance(value, torch.Tensor) else None)
                              for key, value in state[param].items()) if param in state else ())
            for group in optimizer.param_groups for param in group["params"])))
    return tuple(parts)


class TensorCollector:
    """``collect_tensors``, answered from the last call's entries while the fingerprint is the same: the same list
    object then, which tells the caller that what it derived from it still holds."""

    def __init__(self) -> None:
        self._fingerprint: Optional[Hashable] = None
        self._collected: Optional[Tuple[List[Entry], ParamIndex]] = None

    def __call__(self, model_modules: Modules, optimizers: Optimizers = None) -> Tuple[List[Entry], ParamIndex]:
        now = fingerprint(model_modules, optimizers)
        if self._collected is None or now != self._fingerprint:
            self._collected = None   # let the old tensors go before collecting the new
            self._collected, self._fingerprint = collect_tensors(model_modules, optimizers), now
        return self._collected

    def clear(self) -> None:
        self._fingerprint = self._collected = None
