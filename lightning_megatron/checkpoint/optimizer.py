"""Optimizer state under the parameters' global names, sharded like the parameters.

A ``torch.optim`` optimizer keys its state by parameter object; a checkpoint that must reshard
keys it by global name instead: ``optimizer.<i>.state.<global name>.<key>``. A state tensor of
the parameter's shape (Adam's moments) gets the parameter's placement, so it reshards with it;
a scalar (Adam's ``step``) or the state of an unsharded parameter is stored whole, non-tensors
pickled; other shapes (factored second moments) cannot be resharded and are refused. Hyper-parameters
(``param_groups`` minus ``params``) are one pickled list; loading keeps the new optimizer's own
group membership and restores the values (lr, betas, ... , an LR scheduler's ``initial_lr``).
Loading goes through ``optimizer.load_state_dict``, so the optimizer's own dtype/device rules
apply (Adam keeps ``step`` on the CPU unless ``capturable``/``fused``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .entries import Entry
from .keys import param_groups_key, split_state_key, state_key
from .placement import Placement, whole

ParamIndex = Dict[int, Tuple[str, Placement]]  # id(param) → (global name, placement)


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _name_of(param: torch.Tensor, params: ParamIndex, index: int) -> Tuple[str, Placement]:
    found = params.get(id(param))
    if found is None:
        raise ValueError(f"optimizer {index} holds a parameter of shape {tuple(param.shape)} that is not in the "
                         "model modules passed; pass every module whose parameters the optimizer updates.")
    return found


def hyperparameters(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def optimizer_entries(optimizer: torch.optim.Optimizer, index: int, params: ParamIndex) -> Dict[str, Entry]:
    """The tensor entries of optimizer ``index``'s per-parameter state (its other values: ``optimizer_objects``)."""
    entries: Dict[str, Entry] = {}
    for param in _params(optimizer):
        name, placement = _name_of(param, params, index)
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            full_key = state_key(index, name, key)
            value = value.detach()
            if full_key in entries:
                entries[full_key].tensors.append(value)  # a tied copy's state on this rank
                continue
            shaped = tuple(value.shape) == tuple(param.shape)
            if not shaped and value.dim() > 0 and placement != whole(param):
                raise ValueError(
                    f"optimizer {index} keeps {key!r} of shape {tuple(value.shape)} for the sharded parameter {name!r} "
                    f"(local shape {tuple(param.shape)}): only state shaped like its parameter (Adam, SGD momentum) "
                    f"or scalars can be resharded.")
            entries[full_key] = Entry(full_key, placement if shaped else whole(value), [value])
    return entries


def optimizer_objects(optimizer: torch.optim.Optimizer, index: int, params: ParamIndex) -> Dict[str, Any]:
    """The per-parameter state values of optimizer ``index`` that are not tensors (stored pickled)."""
    blobs: Dict[str, Any] = {}
    for param in _params(optimizer):
        state = optimizer.state.get(param)
        if state:
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    blobs[state_key(index, _name_of(param, params, index)[0], key)] = value
    return blobs


class OptimizerLoad:
    """Targets to read optimizer ``index``'s state into, then ``finish`` hands them to the optimizer.

    A parameter whose state the checkpoint lacks (it never received a gradient) keeps none.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, params: ParamIndex,
                 metadata: Metadata) -> None:
        self.optimizer, self.index = optimizer, index
        self.entries: Dict[str, Entry] = {}
        self.blob_keys: List[str] = [param_groups_key(index)]
        self._slots: Dict[int, Dict[str, str]] = {}   # param position → state key → checkpoint key
        saved: Dict[str, Dict[str, Any]] = {}
        for key, md in metadata.state_dict_metadata.items():
            split = split_state_key(index, key)
            if split is not None:
                saved.setdefault(split[0], {})[split[1]] = md
        for position, param in enumerate(_params(optimizer)):
            name, placement = _name_of(param, params, index)
            existing = optimizer.state.get(param, {})
            slots = self._slots.setdefault(position, {})
            for key, md in saved.get(name, {}).items():
                full_key = state_key(index, name, key)
                slots[key] = full_key
                if isinstance(md, BytesStorageMetadata):
                    self.blob_keys.append(full_key)
                    continue
                assert isinstance(md, TensorStorageMetadata)
                if full_key in self.entries:      # tied copy on this rank: filled after the read
                    continue
                dtype = md.properties.dtype
                if tuple(md.size) == placement.global_shape and placement.global_shape != ():
                    # zeros, not empty: rows a checkpoint leaves out (vocabulary padding) stay zero
                    target = torch.zeros(param.shape, dtype=dtype, device=param.device)
                    self.entries[full_key] = Entry(full_key, placement, [target])
                else:
                    old = existing.get(key)
                    device = old.device if isinstance(old, torch.Tensor) else torch.device("cpu")
                    target = torch.zeros(tuple(md.size), dtype=dtype, device=device)
                    self.entries[full_key] = Entry(full_key, whole(target), [target])

    def check(self, blobs_available: Callable[[str], bool]) -> Optional[str]:
        if not blobs_available(param_groups_key(self.index)):
            return (f"the checkpoint holds no state of optimizer {self.index} "
                    f"({param_groups_key(self.index)!r} is missing); pass optimizers=None to load the model only.")
        return None

    def finish(self, blobs: Dict[str, Any]) -> None:
        saved_groups = blobs[param_groups_key(self.index)]
        current = self.optimizer.state_dict()["param_groups"]
        if len(saved_groups) != len(current):
            raise ValueError(f"optimizer {self.index} has {len(current)} param groups but the checkpoint has "
                             f"{len(saved_groups)}; build the optimizer with the same groups as when saving.")
        groups = [{**saved, "params": group["params"]} for saved, group in zip(saved_groups, current)]
        state: Dict[int, Dict[str, Any]] = {}
        used = set()
        for position, slots in self._slots.items():
            if not slots:
                continue
            state[position] = {}
            for key, k in slots.items():
                value = self.entries[k].local if k in self.entries else blobs[k]
                if isinstance(value, torch.Tensor):
                    if id(value) in used:   # a tied copy on this rank needs state of its own
                        value = value.clone()
                    used.add(id(value))
                state[position][key] = value
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
