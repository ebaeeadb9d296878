"""The distributed optimizer's state in a form that does not depend on the data-parallel size.

``full_state_dict`` is torch's own ``Optimizer.state_dict()`` format over the *model's* parameters
(indices in the order the user's optimizer was built with), exactly what the optimizer would
hold unsharded, plus ``"main_params"`` (the float32 masters of low-precision parameters) and
``"elementwise"`` (which state entries are per-element). Every data-parallel rank of a group ends
up with the whole state, in host memory (a collective), so any rank's copy loads at any DP size:
``load_full_state_dict`` keeps this rank's pieces. A plain (unsharded) optimizer's state dict
loads too, and the full state loads into a plain optimizer (torch ignores the extra keys).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .distributed_optimizer import DistributedOptimizer, Shard

FORMAT = "lightning_megatron.distributed_optimizer/1"


def _shards_in_order(dist_opt: DistributedOptimizer, optimizer: torch.optim.Optimizer) -> List[Shard]:
    """This rank's shards in the order torch's ``state_dict`` numbers them."""
    return [dist_opt.shard_of(main) for group in optimizer.param_groups for main in group["params"]]


def _is_elementwise(value: Any, like: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == like.shape


def full_state_dict(dist_opt: DistributedOptimizer, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The unsharded state of ``optimizer`` (one of ``dist_opt``'s); a collective over every DP group."""
    originals = dist_opt.originals[id(optimizer)]
    index = {id(p): i for i, p in enumerate(originals)}
    local = optimizer.state_dict()
    shards = _shards_in_order(dist_opt, optimizer)
    state: Dict[int, Dict[str, Any]] = {}
    elementwise: Dict[int, List[str]] = {}
    main_params: Dict[int, torch.Tensor] = {}
    for buffer in dist_opt.grads.buffers:          # the same order on every rank
        mine = [(j, s) for j, s in enumerate(shards) if s.grads is buffer]
        keys: Dict[str, str] = {}
        scalars: Dict[int, Dict[str, Any]] = {}
        for j, shard in mine:
            entry = local["state"].get(j)
            if entry is None:
                continue
            i = index[id(shard.param)]
            scalars.setdefault(i, {})
            for key, value in entry.items():
                if _is_elementwise(value, shard.main):
                    keys[key] = str(value.dtype).replace("torch.", "")
                else:
                    scalars[i][key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
        for other_keys, other_scalars in _all_gather_object((keys, scalars), buffer):
            keys.update(other_keys)
            for i, entry in other_scalars.items():
                scalars.setdefault(i, {}).update(entry)
        params = [p for p in buffer.params if id(p) in index and index[id(p)] in scalars]
        for key in sorted(keys):
            full = _assemble(buffer, mine, lambda j, s: local["state"].get(j, {}).get(key), getattr(torch, keys[key]))
            for param in params:
                start, end = buffer.ranges[id(param)]
                state.setdefault(index[id(param)], {})[key] = _host(full[start:end].view_as(param))
                elementwise.setdefault(index[id(param)], []).append(key)
        for i, entry in scalars.items():
            state.setdefault(i, {}).update(entry)
        if any(p.dtype in (torch.float16, torch.bfloat16) for p in buffer.params):
            full = _assemble(buffer, mine, lambda j, s: s.main.detach(), torch.float32)
            for param in buffer.params:
                if id(param) in index:
                    start, end = buffer.ranges[id(param)]
                    main_params[index[id(param)]] = _host(full[start:end].view_as(param))
    groups = []
    for group, saved in zip(_original_groups(dist_opt, optimizer, index), local["param_groups"]):
        groups.append({**copy.deepcopy({k: v for k, v in saved.items() if k != "params"}), "params": group})
    return {"state": state, "param_groups": groups, "main_params": main_params, "elementwise": elementwise,
            "format": FORMAT}


def load_full_state_dict(dist_opt: DistributedOptimizer, optimizer: torch.optim.Optimizer,
                         full: Dict[str, Any]) -> None:
    """Load a full (or plain torch) optimizer state: keep this rank's pieces of it."""
    originals = dist_opt.originals[id(optimizer)]
    saved_groups = full["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
                         f"{len(optimizer.param_groups)}; build configure_optimizers' groups as when it was saved.")
    saved_count = sum(len(g["params"]) for g in saved_groups)
    if saved_count != len(originals):
        raise ValueError(f"the checkpoint's optimizer holds {saved_count} parameters, this one {len(originals)}; "
                         "the model or its optimizer groups differ from the ones saved.")
    index = {id(p): i for i, p in enumerate(originals)}
    elementwise: Optional[Dict[int, List[str]]] = full.get("elementwise")
    shards = _shards_in_order(dist_opt, optimizer)
    state: Dict[int, Dict[str, Any]] = {}
    for j, shard in enumerate(shards):
        i = index[id(shard.param)]
        saved = full["state"].get(i)
        if saved is None:
            continue
        state[j] = {key: shard.piece_of(value, key in elementwise.get(i, ()) if elementwise is not None else None)
                    for key, value in saved.items()}
    groups, position = [], 0
    for group, saved in zip(optimizer.param_groups, saved_groups):
        groups.append({**{k: v for k, v in saved.items() if k != "params"},
                       "params": list(range(position, position + len(group["params"])))})
        position += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    dist_opt.reload_main_params()
    with torch.no_grad():
        for shard in shards:
            master = full.get("main_params", {}).get(index[id(shard.param)])
            if master is not None and not shard.is_view:
                shard.main.copy_(master.reshape(-1)[shard.param_start:shard.param_end])


def _original_groups(dist_opt: DistributedOptimizer, optimizer: torch.optim.Optimizer,
                     index: Dict[int, int]) -> List[List[int]]:
    """Indices of each group's model parameters as the optimizer was built (shards lose the absent)."""
    originals = dist_opt.originals[id(optimizer)]
    sizes = dist_opt.group_sizes[id(optimizer)]
    groups, position = [], 0
    for size in sizes:
        groups.append([index[id(p)] for p in originals[position:position + size]])
        position += size
    return groups


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: the full state is as large as an unsharded optimizer's."""
    return tensor.to("cpu", copy=True)


def _assemble(buffer: Any, mine: List[Tuple[int, Shard]], value_of: Any, dtype: torch.dtype) -> torch.Tensor:
    """A buffer-shaped tensor of every rank's pieces (zeros elsewhere), summed over the group."""
    flat = torch.zeros(buffer.numel, dtype=dtype, device=buffer.data.device)
    for j, shard in mine:
        value = value_of(j, shard)
        if value is not None:
            flat[shard.start:shard.end].copy_(value)
    if buffer.group_size > 1:
        dist.all_reduce(flat, group=buffer.group)
    return flat


def _all_gather_object(obj: Any, buffer: Any) -> List[Any]:
    if buffer.group_size == 1:
        return []
    out: List[Any] = [None] * buffer.group_size
    dist.all_gather_object(out, obj, group=buffer.group)
    return out


MAIN_PARAM_KEY = "main_param"


class FullOptimizerView:
    """One optimizer of the distributed optimizer, seen as the plain optimizer it stands for.

    ``param_groups`` list the model's parameters and ``state`` is keyed by them, whole over data
    parallelism (host memory), with the float32 masters of low-precision parameters as one more
    per-parameter entry (``"main_param"``). The sharded checkpoint writer and reader, which reshard
    TP/PP/EP, take it like any ``torch.optim`` optimizer; ``load_state_dict`` keeps this rank's pieces.
    """

    def __init__(self, full: Dict[str, Any], originals: Sequence[torch.Tensor],
                 dist_opt: Optional[DistributedOptimizer] = None, optimizer: Optional[torch.optim.Optimizer] = None):
        self._originals, self._dist_opt, self._optimizer = originals, dist_opt, optimizer
        self._groups = full["param_groups"]
        self.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [originals[i] for i in g["params"]]} for g in self._groups]
        self.state: Dict[torch.Tensor, Dict[str, Any]] = {originals[i]: dict(s) for i, s in full["state"].items()}
        for i, master in full.get("main_params", {}).items():
            self.state.setdefault(originals[i], {})[MAIN_PARAM_KEY] = master

    @classmethod
    def gather(cls, dist_opt: DistributedOptimizer, optimizer: torch.optim.Optimizer,
               keep_optimizer: bool = True) -> "FullOptimizerView":
        """The whole state, gathered now (a collective over every DP group)."""
        return cls(full_state_dict(dist_opt, optimizer), dist_opt.originals[id(optimizer)],
                   dist_opt if keep_optimizer else None, optimizer if keep_optimizer else None)

    @classmethod
    def to_load(cls, dist_opt: DistributedOptimizer, optimizer: torch.optim.Optimizer) -> "FullOptimizerView":
        """An empty view to read a checkpoint into (no collective)."""
        originals = dist_opt.originals[id(optimizer)]
        index = {id(p): i for i, p in enumerate(originals)}
        groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": group}
                  for group, saved in zip(_original_groups(dist_opt, optimizer, index), optimizer.param_groups)]
        return cls({"state": {}, "param_groups": groups}, originals, dist_opt, optimizer)

    def state_dict(self) -> Dict[str, Any]:
        index = {id(p): i for i, p in enumerate(self._originals)}
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()},
                "param_groups": [dict(g) for g in self._groups]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self._dist_opt is None:
            raise RuntimeError("this optimizer view holds saved state only; build it with to_load() to load.")
        assert self._optimizer is not None   # given together with dist_opt
        state = {i: dict(s) for i, s in state_dict["state"].items()}
        masters = {i: s.pop(MAIN_PARAM_KEY) for i, s in state.items() if MAIN_PARAM_KEY in s}
        elementwise = {i: [k for k, v in s.items() if _is_elementwise(v, self._originals[i])] for i, s in state.items()}
        full = {"state": state, "param_groups": state_dict["param_groups"], "main_params": masters,
                "elementwise": elementwise}
        load_full_state_dict(self._dist_opt, self._optimizer, full)
