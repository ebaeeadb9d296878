"""Process-group topology (pure) and the process groups built from it."""

from .state import GROUP_NAMES, ParallelState, chunk_position, get_parallel_state, has_parallel_state
from .topology import DEFAULT_ORDER, ParallelConfigError, ParallelLayout, RankGenerator

__all__ = [
    "DEFAULT_ORDER", "GROUP_NAMES", "ParallelConfigError", "ParallelLayout", "ParallelState",
    "RankGenerator", "chunk_position", "get_parallel_state", "has_parallel_state",
]
