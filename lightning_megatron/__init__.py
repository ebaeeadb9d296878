"""Megatron-style parallelism for ordinary PyTorch Lightning modules.

``import lightning_megatron`` makes ``Trainer(strategy="megatron")`` work. It imports neither Lightning
nor the machinery: public names load on first use, and the strategy's name is registered with Lightning's
StrategyRegistry when Lightning itself is imported (see ``_registration.py``).
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_face
from ._registration import register_when_lightning_loads

__version__ = "0.1.0.dev0"

__getattr__, __dir__ = lazy_face(__name__, {
    "MegatronStrategy": ".adapter.strategy",
    "MegatronThroughputMonitor": ".adapter.callbacks",
    "ShardedCheckpointIO": ".adapter.checkpoint_io",
    "ParallelLayout": ".parallel.topology",
    "RankGenerator": ".parallel.topology",
    "ParallelState": ".parallel.state",
    "get_parallel_state": ".parallel.state",
})

if TYPE_CHECKING:
    from .adapter.callbacks import MegatronThroughputMonitor
    from .adapter.checkpoint_io import ShardedCheckpointIO
    from .adapter.strategy import MegatronStrategy
    from .parallel.state import ParallelState, get_parallel_state
    from .parallel.topology import ParallelLayout, RankGenerator

register_when_lightning_loads()

__all__ = ["MegatronStrategy", "MegatronThroughputMonitor", "ParallelLayout", "ParallelState", "RankGenerator",
           "ShardedCheckpointIO", "get_parallel_state", "__version__"]
