"""Process-group topology (pure) and the process groups built from it."""

from typing import TYPE_CHECKING

from .._lazy import lazy_face

__getattr__, __dir__ = lazy_face(__name__, {
    'GROUP_NAMES': '.state',
    'ParallelState': '.state',
    'chunk_position': '.state',
    'get_parallel_state': '.state',
    'has_parallel_state': '.state',
    'ParallelConfig': '.config',
    'DEFAULT_ORDER': '.topology',
    'ParallelConfigError': '.topology',
    'ParallelLayout': '.topology',
    'RankGenerator': '.topology',
})

if TYPE_CHECKING:
    from .config import ParallelConfig
    from .state import GROUP_NAMES, ParallelState, chunk_position, get_parallel_state, has_parallel_state
    from .topology import DEFAULT_ORDER, ParallelConfigError, ParallelLayout, RankGenerator

__all__ = [
    "DEFAULT_ORDER", "GROUP_NAMES", "ParallelConfig", "ParallelConfigError", "ParallelLayout", "ParallelState",
    "RankGenerator", "chunk_position", "get_parallel_state", "has_parallel_state",
]
