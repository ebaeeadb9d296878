"""``save_sharded`` / ``load_sharded``: every rank writes and reads only its own shards, in parallel.

Collective: call on every rank with the same path. Every tensor is stored under its global
name, with its global shape and the offsets of the pieces ranks hold, so a checkpoint saved at
one layout (TP, PP, VPP, DP, EP sizes) loads at any other. Problems found before the collective
read (missing keys, shape mismatches, incomplete folders) are agreed on by all ranks first, so
every rank raises the same error instead of some ranks hanging. Every stored item carries a crc32
(``checksums.py``): a shard damaged on disk raises ``CorruptCheckpointError`` instead of loading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import folder
from .checksums import ChecksumWriter, load_checked
from .collective import agree, rank
from .entries import Entry, Modules, as_list, check_entries, model_entries, unexpected_keys
from .errors import CheckpointError, CheckpointMismatchError, IncompleteCheckpointError, summarize_failures
from .info import layout_info
from .keys import EXTRA_STATE, INFO, param_groups_key, rank_state_key
from .optimizer import OptimizerLoad, ParamIndex, hyperparameters, optimizer_entries, optimizer_objects
from .planner import PieceLoadPlanner, PieceSavePlanner

Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def save_sharded(path: Union[str, os.PathLike], model_modules: Modules, optimizers: Optimizers = None,
                 extra_state: Any = None, *, rank_state: Any = None, checksums: bool = False) -> None:
    """Write a sharded checkpoint folder at ``path`` atomically (collective).

    ``model_modules``: this rank's module(s) (a LightningModule, a model, or its chunks);
    ``optimizers``: their optimizer(s), state saved shard-wise under global names;
    ``extra_state``: one picklable object the same on every rank (trainer loops, schedulers;
    rank 0's copy is stored); ``rank_state``: a picklable object per rank (RNG states), read back
    with ``load_rank_state``; ``checksums``: write a crc32 of every stored item, checked at load
    (``checksums.py``). The folder appears at ``path`` only once every rank finished.
    """
    prepare_save(path, model_modules, optimizers, extra_state, rank_state=rank_state, checksums=checksums).write()


@dataclass
class SaveJob:
    """A save whose entries and objects are known and whose staging folder exists: what is left is the write."""

    path: str
    staging: str
    entries: List[Entry]
    blobs: Dict[str, Any]
    checksums: bool = False

    def write(self) -> None:
        """Write every rank's shards and make the folder visible (collective over the world: the training's, or the
        writing processes' own for a background save)."""
        writer = ChecksumWriter(self.staging) if self.checksums else dcp.FileSystemWriter(self.staging)
        try:
            dcp.save({}, storage_writer=writer, planner=PieceSavePlanner(self.entries, self.blobs))
        except CheckpointException as err:   # a BaseException: turn it into an ordinary error
            raise CheckpointError(f"saving {self.path} failed ({summarize_failures(err)}); nothing was committed: "
                                  f"what was at {self.path} before is untouched and the partial write stays in "
                                  f"{self.staging}.") from err
        folder.commit(self.staging, self.path)


def collect_save(model_modules: Modules, optimizers: Optimizers = None, extra_state: Any = None, *,
                 rank_state: Any = None) -> Tuple[List[Entry], Dict[str, Any]]:
    """What this rank writes: the tensor entries (model, then optimizer state) and the objects (not collective)."""
    entries, of_param = collect_tensors(model_modules, optimizers)
    return entries, collect_objects(of_param, optimizers, extra_state, rank_state=rank_state)


def collect_tensors(model_modules: Modules, optimizers: Optimizers = None) -> Tuple[List[Entry], ParamIndex]:
    """The tensor entries this rank writes (model, then optimizer state) and ``id(param) → (name, placement)``."""
    model = model_entries(model_modules)
    entries: List[Entry] = list(model.by_name.values())
    for i, optimizer in enumerate(as_list(optimizers)):
        entries += optimizer_entries(optimizer, i, model.of_param).values()
    return entries, model.of_param


def collect_objects(of_param: ParamIndex, optimizers: Optimizers = None, extra_state: Any = None, *,
                    rank_state: Any = None) -> Dict[str, Any]:
    """The objects this rank writes (pickled): optimizer hyper-parameters and non-tensor state, the layout, the
    caller's ``extra_state`` (rank 0's) and ``rank_state``."""
    blobs: Dict[str, Any] = {}
    for i, optimizer in enumerate(as_list(optimizers)):
        blobs.update(optimizer_objects(optimizer, i, of_param))
        if rank() == 0:
            blobs[param_groups_key(i)] = hyperparameters(optimizer)
    if rank() == 0:
        blobs[INFO] = layout_info()
        if extra_state is not None:
            blobs[EXTRA_STATE] = extra_state
    if rank_state is not None:
        blobs[rank_state_key(rank())] = rank_state
    return blobs


def prepare_save(path: Union[str, os.PathLike], model_modules: Modules, optimizers: Optimizers = None,
                 extra_state: Any = None, *, rank_state: Any = None, checksums: bool = False,
                 stage: Optional[Callable[[List[Entry], Dict[str, Any]], Tuple[List[Entry], Dict[str, Any]]]] = None,
                 collect: Callable[[Modules, Optimizers], Tuple[List[Entry], ParamIndex]] = collect_tensors,
                 ) -> SaveJob:
    """Collect what this rank writes (``collect``: its tensors, as ``collect_tensors``; ``stage``: turn it into a
    snapshot), agree on it and create the staging folder (collective): a problem on any rank is raised on every rank
    before anything is written."""
    path = os.fspath(path)
    error: Optional[Exception] = None
    entries: List[Entry] = []
    blobs: Dict[str, Any] = {}
    staging = folder.staging_path(path)
    try:
        entries, of_param = collect(model_modules, optimizers)
        blobs = collect_objects(of_param, optimizers, extra_state, rank_state=rank_state)
        if stage is not None:
            entries, blobs = stage(entries, blobs)
        folder.begin(path)   # rank 0 (within the one agreement below: a save call makes a single collective)
    except Exception as err:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = err
    paths = agree(error, path)
    if len(set(paths)) > 1:
        raise ValueError(f"save_sharded was called with different paths on different ranks: {sorted(set(paths))}; "
                         "pass the same path everywhere (broadcast it from rank 0).")
    return SaveJob(path, staging, entries, blobs, checksums)


def load_sharded(path: Union[str, os.PathLike], model_modules: Modules, optimizers: Optimizers = None,
                 strict: bool = True, *, prefix: str = "") -> Any:
    """Load a checkpoint into ``model_modules`` (and ``optimizers``) at the current layout; return
    its ``extra_state`` (collective).

    ``path`` is a folder written by :func:`save_sharded` or a file written by :func:`consolidate`
    (model weights only). ``strict``: every model tensor must be in the checkpoint and every model
    tensor of the checkpoint (under ``prefix``) must be in the model. ``prefix`` is prepended to
    the model's global names, e.g. ``"model."`` to load a bare model out of the checkpoint of a
    LightningModule that holds it as ``self.model``.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        if as_list(optimizers):   # resuming (trainer.fit(ckpt_path=...)) needs the optimizer state of a folder
            raise IncompleteCheckpointError(folder.not_a_checkpoint_folder(
                path, "it is a file, and resuming training needs the optimizer and trainer state of a folder"))
        from .consolidate import load_consolidated
        load_consolidated(path, model_modules, strict=strict, prefix=prefix)
        return None
    error, plan, keys = None, None, []
    try:
        metadata = folder.check_folder(path)
        plan = _LoadPlan(metadata, model_modules, as_list(optimizers), strict, prefix)
        keys = [entry.key for entry in plan.model.by_name.values()]
        error = plan.problem
    except Exception as err:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = err
    everyone = agree(error, keys)
    assert plan is not None  # agree raised every rank's error: the plan was built
    if strict:
        wanted = {key for rank_keys in everyone for key in rank_keys}
        extra = unexpected_keys(plan.metadata.state_dict_metadata, wanted, prefix)
        if extra:
            raise CheckpointMismatchError(
                f"{extra[0]!r} (and {len(extra) - 1} more) is in the checkpoint but no rank's model has it: the "
                f"checkpoint comes from a different architecture; pass strict=False to ignore such keys.")
    planner = PieceLoadPlanner(plan.entries, plan.blob_keys)
    try:
        load_checked(path, planner)
    except CheckpointException as err:
        raise CheckpointError(f"loading {path} failed ({summarize_failures(err)}).") from err
    with torch.no_grad():
        for entry in plan.entries:
            for copy in entry.tensors[1:]:
                copy.copy_(entry.local)      # tied copies on this rank
    for optimizer_load in plan.optimizers:
        optimizer_load.finish(planner.blobs)
    return planner.blobs.get(EXTRA_STATE)


class _LoadPlan:
    """What this rank reads: model entries, optimizer targets, pickled objects; and the first problem."""

    def __init__(self, metadata, model_modules: Modules, optimizers: List[torch.optim.Optimizer],
                 strict: bool, prefix: str) -> None:
        self.metadata = metadata
        saved = metadata.state_dict_metadata
        shapes = {k: tuple(md.size) for k, md in saved.items() if isinstance(md, TensorStorageMetadata)}
        self.model = model_entries(model_modules, prefix)
        self.problem: Optional[Exception] = None
        message = check_entries(self.model.by_name.values(), shapes, strict)
        if message:
            self.problem = CheckpointMismatchError(message)
        self.entries: List[Entry] = [e for e in self.model.by_name.values() if e.key in saved]
        self.optimizers = [OptimizerLoad(opt, i, self.model.of_param, metadata) for i, opt in enumerate(optimizers)]
        for optimizer_load in self.optimizers:
            message = optimizer_load.check(lambda key: key in saved)
            if message and self.problem is None:
                self.problem = CheckpointMismatchError(message)
            self.entries += optimizer_load.entries.values()
        self.blob_keys = [k for k in [EXTRA_STATE] if k in saved]
        for optimizer_load in self.optimizers:
            self.blob_keys += [k for k in optimizer_load.blob_keys if k in saved]
