"""Lightning's checkpoint dict as a sharded folder, and back.

The weights and optimizer states go shard by shard under global names (``save_sharded``); what is
left of Lightning's dict (loops, schedulers, callbacks, hyper-parameters) rides along as the
folder's extra state, and each rank's RNG streams as its rank state. Loading reads the shards
straight into the parameters and optimizers, so the dict handed back to Lightning carries a marker
(``SHARDED_KEY``) telling the strategy's load hooks that there is nothing left to copy.
Lightning-free: the strategy passes the dict and the objects.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .rng_state import capture_rng_state, restore_rng_state
from ..tensor_parallel.random import RNGStatesTracker
from .background import BackgroundSaver
from .info import load_rank_state
from .sharded import load_sharded, save_sharded

SHARDED_KEY = "megatron_sharded"


def save_trainer_checkpoint(path: Union[str, os.PathLike], checkpoint: Mapping[str, Any], modules: Sequence[Any],
                            optimizers: List[Any], rng_tracker: RNGStatesTracker, *, checksums: bool = False,
                            background: Optional[BackgroundSaver] = None) -> None:
    """Write ``checkpoint`` (Lightning's dict; its ``state_dict``/``optimizer_states`` are ignored: the
    shards hold them) for ``modules`` and ``optimizers`` (collective); through ``background`` when given."""
    extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    save = background.save if background is not None else save_sharded
    save(path, list(modules), optimizers, extra_state=extra, rank_state=capture_rng_state(rng_tracker),
         checksums=checksums)


def load_trainer_checkpoint(path: Union[str, os.PathLike], modules: Sequence[Any], optimizers: Optional[List[Any]],
                            rng_tracker: RNGStatesTracker, strict: bool = True) -> Dict[str, Any]:
    """Read the folder into ``modules`` (and ``optimizers`` when given: fitting) and return Lightning's
    dict, marked as loaded in place. RNG streams come back when the layout is the one that saved them."""
    extra = dict(load_sharded(path, list(modules), optimizers, strict=strict) or {})
    rng = load_rank_state(path)
    if rng is not None:
        restore_rng_state(rng, rng_tracker)
    extra[SHARDED_KEY] = True
    extra.setdefault("state_dict", {})
    extra["optimizer_states"] = [{} for _ in optimizers] if optimizers is not None else []
    return extra


def loaded_in_place(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` came from ``load_trainer_checkpoint`` (weights and states already in place)."""
    return bool(checkpoint.get(SHARDED_KEY))


def remove_checkpoint_path(path: Union[str, os.PathLike]) -> None:
    """Delete a checkpoint folder (or a file written by another strategy)."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
