"""The tensor entries of one background save kept for the next, while the same tensors back them.

Collecting a save's entries walks every module (global names, placements) and optimizer state in Python: GPT-1.3B's
1168 entries took ~35 ms of a save call on an H200's host, paid while the GPU waits. A fingerprint of what the
entries are made from (this rank's parallel positions; every parameter, persistent buffer and optimizer-state
tensor: its identity, storage address, shape, stride and dtype; the optimizers and the state keys) costs 3-5 ms
there and is taken at every save: while it is the same, the cached entries are exactly what collecting again would give (they
hold those storages, so no other tensor can take their addresses and be mistaken for them). Anything swapped, added,
moved, re-sharded or re-created (a reloaded optimizer, ``param.data = ...``) changes it and the entries are collected
again. The distributed optimizer's gathered views are new tensors at every save: always collected.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

import torch

from .entries import Entry, Modules, as_list, current_ranks
from .optimizer import ParamIndex
from .sharded import Optimizers, collect_tensors


def _described(tensors: Iterable[torch.Tensor]) -> List[Tuple[Any, ...]]:
    return [(id(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]


def fingerprint(model_modules: Modules, optimizers: Optimizers = None) -> List[Any]:
    """What ``collect_tensors(model_modules, optimizers)`` depends on, cheaply (equal only if it would be equal):
    the parallel positions, the names and tensors of every parameter and persistent buffer, each optimizer's
    parameters in order, the keys of their state, and its tensors."""
    parts: List[Any] = [current_ranks()]
    for module in as_list(model_modules):
        names, tensors = [], []
        for path, sub in module.named_modules():   # one walk for parameters and persistent buffers
            for name, tensor in sub._parameters.items():
                names.append((path, name))
                tensors.append(tensor)
            for name, tensor in sub._buffers.items():
                if name not in sub._non_persistent_buffers_set:
                    names.append((path, name))
                    tensors.append(tensor)
        parts += [names, _described([tensor for tensor in tensors if tensor is not None]),
                  [tensor is None for tensor in tensors]]
    for optimizer in as_list(optimizers):
        states = list(optimizer.state.items())   # in the dict's order: no tensor hashing
        values = [value for _, state in states for value in state.values()]
        parts += [id(optimizer), [id(param) for group in optimizer.param_groups for param in group["params"]],
                  [(id(param), list(state)) for param, state in states],
                  _described([value for value in values if isinstance(value, torch.Tensor)]),
                  [isinstance(value, torch.Tensor) for value in values]]
    return parts


class TensorCollector:
    """``collect_tensors``, answered from the last call's entries while the fingerprint is the same: the same list
    object then, which tells the caller that what it derived from it still holds."""

    def __init__(self) -> None:
        self._fingerprint: Optional[List[Any]] = None
        self._collected: Optional[Tuple[List[Entry], ParamIndex]] = None

    def __call__(self, model_modules: Modules, optimizers: Optimizers = None) -> Tuple[List[Entry], ParamIndex]:
        now = fingerprint(model_modules, optimizers)
        if self._collected is None or now != self._fingerprint:
            self._collected = None   # let the old tensors go before collecting the new
            self._collected, self._fingerprint = collect_tensors(model_modules, optimizers), now
        return self._collected

    def clear(self) -> None:
        self._fingerprint = self._collected = None
