"""Between a rank's local parameters and the single-process model they are a piece of.

A parameter's *global name* is its name in the model built with PP=1 (the layer index in
``layers.<i>`` is the global one) and its *full tensor* is the one TP=1 would hold. Importers,
exporters and checkpoints all go through these two mappings.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel.mappings import gather_along_dim

_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.*)$")


def layer_index_maps(model: nn.Module) -> Dict[str, list]:
    """``{"<module path>.layers": [global index of local layer 0, 1, ...]}`` for every stage stack."""
    maps = {}
    for name, module in model.named_modules():
        indices = getattr(module, "layer_indices", None)
        if indices is not None and isinstance(getattr(module, "layers", None), nn.ModuleList):
            maps[f"{name}.layers" if name else "layers"] = list(indices)
    return maps


def global_name(local_name: str, maps: Dict[str, list]) -> str:
    """``encoder.layers.0.mlp.fc1.weight`` on a stage holding layers 6.. → ``encoder.layers.6....``."""
    match = _LAYER.match(local_name)
    if match and match["prefix"] in maps:
        return f"{match['prefix']}.{maps[match['prefix']][int(match['index'])]}.{match['rest']}"
    return local_name


def shard_of(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param`` (honouring ``partition_dim``/``partition_stride``)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = torch.split(full, full.shape[dim] // (tp_size * stride), dim=dim)
    return torch.cat(blocks[tp_rank::tp_size], dim=dim)


def full_of(shard: torch.Tensor, param: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The full tensor of ``param`` from every tp rank's ``shard`` (a collective over ``group``)."""
    if not getattr(param, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return shard
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = shard.chunk(stride, dim=dim)
    return torch.cat([gather_along_dim(b.contiguous(), dim, group) for b in blocks], dim=dim)
