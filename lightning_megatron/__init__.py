"""Megatron-style parallelism for ordinary PyTorch Lightning modules."""

from .parallel import ParallelLayout, ParallelState, RankGenerator, get_parallel_state

__version__ = "0.1.0.dev0"

__all__ = ["ParallelLayout", "ParallelState", "RankGenerator", "get_parallel_state", "__version__"]
