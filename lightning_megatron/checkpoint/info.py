"""Small objects kept beside the tensors: what the save was (format, layout), per-rank state.

Read without a process group (``no_dist``): any process can inspect a checkpoint.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Union

import torch

from ..parallel import get_parallel_state, has_parallel_state
from . import folder
from .checksums import load_checked
from .collective import rank as current_rank
from .collective import world_size
from .keys import FORMAT, INFO, rank_state_key
from .planner import PieceLoadPlanner


def layout_info() -> Dict[str, Any]:
    """This run's format, torch version, world size and parallel sizes (stored as ``checkpoint_info``)."""
    info: Dict[str, Any] = {"format": FORMAT, "torch": torch.__version__, "world_size": world_size()}
    if has_parallel_state():
        s = get_parallel_state()
        info["layout"] = {"tp": s.tp_size, "pp": s.pp_size, "cp": s.cp_size, "dp": s.dp_size, "ep": s.ep_size,
                          "etp": s.etp_size, "vpp": s.virtual_pipeline_size or 1}
    return info


def read_objects(path: str, keys: List[str]) -> Dict[str, Any]:
    """The pickled objects ``keys`` of the checkpoint at ``path`` (those it has)."""
    metadata = folder.check_folder(path)
    keys = [k for k in keys if k in metadata.state_dict_metadata]
    if not keys:
        return {}
    planner = PieceLoadPlanner([], keys)
    with warnings.catch_warnings():   # no_dist is the intent here, DCP need not say so
        warnings.simplefilter("ignore", UserWarning)
        load_checked(path, planner, no_dist=True)
    return planner.blobs


def read_info(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """What ``save_sharded`` recorded about the save: format, world size, layout."""
    return read_objects(os.fspath(path), [INFO]).get(INFO, {})


def load_rank_state(path: Union[str, os.PathLike], rank: Optional[int] = None) -> Any:
    """The ``rank_state`` this rank passed to ``save_sharded``, or None when the checkpoint has
    none for it or was saved at another world size or layout (per-rank state, such as RNG
    streams, does not carry over to another layout). Not collective."""
    path = os.fspath(path)
    rank = current_rank() if rank is None else rank
    saved, now = read_info(path), layout_info()
    if saved.get("world_size") != now["world_size"] or saved.get("layout") != now.get("layout"):
        return None
    return read_objects(path, [rank_state_key(rank)]).get(rank_state_key(rank))


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a finished sharded checkpoint folder (what a "latest checkpoint" scan may pick)."""
    return folder.find_metadata(os.fspath(path)) is not None
