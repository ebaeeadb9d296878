"""A rank's model tensors as checkpoint entries: key, global placement, the local tensor(s).

Built from the parameters and persistent buffers (what ``state_dict`` holds) of every module
passed, under global names (``models.sharding.global_names``) and global boxes
(``placement``), so one entry list serves saving, loading at another layout, and loading a
consolidated file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from ..models.sharding import global_names, persistent_buffers
from ..parallel import get_parallel_state, has_parallel_state
from .keys import model_key
from .placement import Placement, Ranks, placement_of

Modules = Union[nn.Module, Sequence[nn.Module]]


@dataclass
class Entry:
    """One stored tensor. ``tensors`` holds more than one local tensor only for tied copies that
    live on the same rank: the first is saved, all are filled on load."""

    key: str
    placement: Placement
    tensors: List[torch.Tensor] = field(default_factory=list)

    @property
    def local(self) -> torch.Tensor:
        return self.tensors[0]


def as_list(items) -> list:
    if items is None:
        return []
    if isinstance(items, (list, tuple)):
        return list(items)
    return [items]


def current_ranks() -> Ranks:
    """This rank's tp/etp/ep positions from the active ``ParallelState`` (all 1-way without one)."""
    if not has_parallel_state():
        return Ranks()
    s = get_parallel_state()
    return Ranks(tp_rank=s.tp_rank, tp_size=s.tp_size, etp_rank=s.etp_rank, etp_size=s.etp_size,
                 ep_rank=s.ep_rank, ep_size=s.ep_size)


def _first_experts(module: nn.Module) -> Dict[int, int]:
    """``id(param) → global index of its local expert 0`` for modules that say so (``GroupedMLP``)."""
    found = {}
    for sub in module.modules():
        first = getattr(sub, "first_expert", None)
        if isinstance(first, int):
            for param in sub.parameters(recurse=False):
                found[id(param)] = first
    return found


@dataclass
class ModelEntries:
    """Entries by global name (model order) and ``id(param) → (global name, placement)``."""

    by_name: Dict[str, Entry]
    of_param: Dict[int, tuple]


def model_entries(modules: Modules, prefix: str = "", ranks: Optional[Ranks] = None) -> ModelEntries:
    """Every parameter and persistent buffer of ``modules`` as an entry keyed ``model.<prefix><global name>``."""
    ranks = ranks or current_ranks()
    by_name: Dict[str, Entry] = {}
    of_param: Dict[int, tuple] = {}
    originals: Dict[str, torch.Tensor] = {}
    for module in as_list(modules):
        names = global_names(module, buffers=True)
        firsts = _first_experts(module)
        tensors = dict(module.named_parameters())
        tensors.update(persistent_buffers(module))
        for local_name, param in tensors.items():
            if id(param) in of_param:
                continue  # the same Parameter reached through two of the modules passed
            name = prefix + names[local_name]
            placement = placement_of(param, ranks, firsts.get(id(param)))
            of_param[id(param)] = (name, placement)
            entry = by_name.get(name)
            if entry is None:
                by_name[name] = Entry(model_key(name), placement, [param.detach()])
                originals[name] = param
                continue
            tied = getattr(param, "shared_embedding", False) and getattr(originals[name], "shared_embedding", False)
            if not tied or entry.placement != placement:
                raise ValueError(
                    f"two different local tensors map to the global name {name!r}; chunks passed as separate "
                    f"modules need global layer indices (a stack with `layer_indices`, as TransformerBlock and "
                    f"PipelineStack have) or one VirtualChunks around them.")
            entry.tensors.append(param.detach())   # a tied copy on this rank
    return ModelEntries(by_name, of_param)


def check_entries(entries: Iterable[Entry], saved_shapes: Dict[str, tuple], strict: bool) -> Optional[str]:
    """The first problem loading ``entries`` from a checkpoint whose tensors have ``saved_shapes``."""
    for entry in entries:
        shape = saved_shapes.get(entry.key)
        if shape is None:
            if not strict:
                continue
            return (f"{entry.key!r} (global shape {entry.placement.global_shape}) is missing from the checkpoint; it "
                    f"was saved from a different architecture or module root (pass prefix=... to load a sub-module, "
                    f"or strict=False to keep this tensor as it is).")
        if tuple(shape) != tuple(entry.placement.global_shape):
            return (f"{entry.key!r} has global shape {tuple(shape)} in the checkpoint but "
                    f"{tuple(entry.placement.global_shape)} in the model: the checkpoint comes from a different "
                    f"architecture (compare hidden size, layers, heads, vocabulary, experts).")
    return None


def unexpected_keys(saved_keys: Iterable[str], wanted: Iterable[str], prefix: str = "") -> List[str]:
    """Model keys of the checkpoint (under ``prefix``) that no rank's model asked for."""
    wanted = set(wanted)
    root = model_key(prefix)
    return [k for k in saved_keys if k.startswith(root) and k not in wanted]
