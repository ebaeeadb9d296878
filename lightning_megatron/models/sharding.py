"""Between a rank's local parameters and the single-process model they are a piece of.

A parameter's *global name* is its name in the model built with PP=1 (the layer index in
``layers.<i>`` is the global one, no ``chunks.<v>.`` of virtual pipeline chunks, and the last
stage's copy of a tied weight named after the weight it copies) and its *full tensor* is the one
TP=1 would hold. Importers, exporters and checkpoints all go through these two mappings.
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


def global_names(model: nn.Module, buffers: bool = False) -> Dict[str, str]:
    """``{local name: global name}`` for every parameter of ``model`` (each once) and, with
    ``buffers``, every persistent buffer (those a ``state_dict`` holds).

    Handles, in this order: tied copies (a module's ``tied_weights = {"output_weight":
    "embedding.word_embeddings.weight"}`` renames a copy marked ``shared_embedding``, which PP>1
    puts on the last stage), the stage's layer offsets (``layer_index_maps``) and the
    ``chunks.<v>.`` level of ``VirtualChunks``, which the single-process model does not have.
    """
    maps = layer_index_maps(model)
    tied: Dict[str, str] = {}
    chunk_roots = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for copy, original in (getattr(module, "tied_weights", None) or {}).items():
            tied[prefix + copy] = prefix + original
        if getattr(module, "chunk_level_in_names", True) is False:   # VirtualChunks says so
            chunk_roots.append(prefix)
    chunk_level = re.compile(r"^(?P<root>" + "|".join(map(re.escape, chunk_roots)) + r")chunks\.\d+\.") \
        if chunk_roots else None

    def to_global(local_name: str, tensor: torch.Tensor) -> str:
        name = local_name
        if name in tied and getattr(tensor, "shared_embedding", False):
            name = tied[name]
        name = global_name(name, maps)
        return chunk_level.sub(lambda m: m["root"], name, count=1) if chunk_level is not None else name

    names = {local_name: to_global(local_name, param) for local_name, param in model.named_parameters()}
    if buffers:
        for local_name, buffer in persistent_buffers(model):
            names[local_name] = to_global(local_name, buffer)
    return names


def persistent_buffers(model: nn.Module):
    """``(name, buffer)`` of the buffers ``model.state_dict()`` holds (not the non-persistent ones)."""
    for path, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), buffer


def shard_of(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` for ``param`` (honouring ``partition_dim``/``partition_stride``)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    # partition_dim: a runtime attribute, set with tensor_model_parallel
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)  # type: ignore[attr-defined]
    blocks = torch.split(full, full.shape[dim] // (tp_size * stride), dim=dim)
    return torch.cat(blocks[tp_rank::tp_size], dim=dim)


def full_of(shard: torch.Tensor, param: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The full tensor of ``param`` from every tp rank's ``shard`` (a collective over ``group``)."""
    if not getattr(param, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return shard
    # partition_dim: a runtime attribute, set with tensor_model_parallel
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)  # type: ignore[attr-defined]
    blocks = shard.chunk(stride, dim=dim)
    return torch.cat([gather_along_dim(b.contiguous(), dim, group) for b in blocks], dim=dim)
