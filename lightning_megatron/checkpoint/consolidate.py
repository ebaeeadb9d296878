"""One process, one file: a sharded checkpoint as the single-process ``state_dict``, and back.

``consolidate`` reads every model tensor whole (no process group needed) and ``torch.save`` s
``{global name: full tensor}``, which ``model.load_state_dict`` of the TP=1/PP=1 model accepts
(tied copies are not repeated, vocabulary padding is not stored: pad with zeros yourself, or
load it with ``load_consolidated``, which places it into any layout like a sharded checkpoint).
The whole model is held in memory once, on the CPU.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..parallel import get_parallel_state, has_parallel_state
from . import folder
from .checksums import load_checked
from .entries import Entry, Modules, check_entries, model_entries, unexpected_keys
from .errors import CheckpointMismatchError, IncompleteCheckpointError
from .keys import MODEL, model_key
from .placement import whole
from .planner import PieceLoadPlanner


def read_full_state_dict(path: Union[str, os.PathLike], prefix: str = "") -> Dict[str, torch.Tensor]:
    """``{global name: full tensor}`` of the model tensors under ``prefix`` (prefix removed)."""
    path = os.fspath(path)
    metadata = folder.check_folder(path)
    root = model_key(prefix)
    entries = []
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(root) and isinstance(md, TensorStorageMetadata):
            tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            entries.append(Entry(key, whole(tensor), [tensor]))
    if not entries:
        raise CheckpointMismatchError(f"{path} holds no model tensors under {root!r}; check prefix={prefix!r}.")
    with warnings.catch_warnings():   # no_dist is the intent here, DCP need not say so
        warnings.simplefilter("ignore", UserWarning)
        load_checked(path, PieceLoadPlanner(entries, []), no_dist=True)
    return {entry.key[len(root):]: entry.local for entry in entries}


def consolidate(path: Union[str, os.PathLike], out_file: Union[str, os.PathLike],
                prefix: str = "") -> Dict[str, torch.Tensor]:
    """Write the single-process ``state_dict`` of the checkpoint at ``path`` to ``out_file``; return it.

    ``prefix`` keeps only the tensors under it and removes it (``"model."`` gives the bare model
    of a LightningModule that holds it as ``self.model``). Not collective: run it on one process.
    """
    state_dict = read_full_state_dict(path, prefix)
    out_file = os.fspath(out_file)
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    partial = out_file + ".incomplete"
    torch.save(state_dict, partial)
    os.replace(partial, out_file)
    return state_dict


@torch.no_grad()
def load_consolidated(file: Union[str, os.PathLike], model_modules: Modules, strict: bool = True,
                      prefix: str = "") -> None:
    """Copy this rank's shards of a consolidated ``state_dict`` file into ``model_modules``.

    Every rank reads the file (memory-mapped) and copies only the boxes it holds, so it works at
    any TP/PP/VPP/EP layout. Not collective; every rank checks the same keys and shapes.
    """
    file = os.fspath(file)
    try:
        full = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - a stray file: say what it should have been
        reason = (str(err).splitlines() or [""])[0][:120]
        raise IncompleteCheckpointError(folder.not_a_checkpoint_folder(
            file, f"it is a file, and not one that consolidate writes: torch.load failed with "
                  f"{type(err).__name__}: {reason}")) from err
    if not isinstance(full, dict) or not all(isinstance(t, torch.Tensor) for t in full.values()):
        held = ("a Lightning checkpoint of another strategy" if isinstance(full, dict) and "state_dict" in full
                else f"a {type(full).__name__}")
        raise IncompleteCheckpointError(folder.not_a_checkpoint_folder(
            file, f"it is a file holding {held}, not the {{name: tensor}} dict that consolidate writes"))
    model = model_entries(model_modules, prefix)
    shapes = {model_key(name): tuple(t.shape) for name, t in full.items()}
    problem = check_entries(model.by_name.values(), shapes, strict)
    if problem:
        raise CheckpointMismatchError(f"{file}: {problem}")
    for name, entry in model.by_name.items():
        if name not in full:
            continue
        for piece in entry.placement.pieces:
            source = piece.of_global(full[name])
            for tensor in entry.tensors:
                piece.view(tensor).copy_(source)
    if strict and _holds_every_stage():
        # with pipeline stages a rank holds only its own names, so only PP=1 can spot strays
        extra = unexpected_keys((model_key(n) for n in full), (e.key for e in model.by_name.values()), prefix)
        if extra:
            raise CheckpointMismatchError(f"{file}: {extra[0][len(MODEL):]!r} (and {len(extra) - 1} more) is in the "
                                          "file but not in the model; pass strict=False to ignore such keys.")


def _holds_every_stage() -> bool:
    return not has_parallel_state() or get_parallel_state().pp_size == 1
