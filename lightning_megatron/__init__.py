"""Megatron-style parallelism for ordinary PyTorch Lightning modules.

Importing the package registers ``strategy="megatron"`` with Lightning's StrategyRegistry
(Lightning has no entry-point discovery for strategies).
"""

from lightning.pytorch.strategies import StrategyRegistry

from .parallel import ParallelLayout, ParallelState, RankGenerator, get_parallel_state
from .strategy import MegatronStrategy

__version__ = "0.1.0.dev0"

if MegatronStrategy.strategy_name not in StrategyRegistry:
    MegatronStrategy.register_strategies(StrategyRegistry)

__all__ = ["MegatronStrategy", "ParallelLayout", "ParallelState", "RankGenerator", "get_parallel_state",
           "__version__"]
