"""Sharded checkpoints through ``torch.distributed.checkpoint``: save at one layout, load at any.

Every rank writes the pieces of the global (single-process) tensors it holds, in parallel, under
global names; loading reads the pieces the new layout needs. Lightning-free: the strategy calls
``save_sharded``/``load_sharded`` from its checkpoint hooks.
"""

from .consolidate import consolidate, load_consolidated, read_full_state_dict
from .errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError
from .hf import export_hf_bert
from .hf_llama import export_hf_llama
from .placement import Piece, Placement, placement_of
from .info import is_checkpoint, load_rank_state, read_info
from .sharded import load_sharded, save_sharded

__all__ = [
    "CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError", "IncompleteCheckpointError", "Piece", "Placement",
    "consolidate", "export_hf_bert", "export_hf_llama", "is_checkpoint", "load_consolidated", "load_rank_state", "load_sharded",
    "placement_of", "read_full_state_dict", "read_info", "save_sharded",
]
