"""Test helpers shipped with the package so users can test their own parallel modules the same way."""

from .multiprocess import MAX_WORLD_SIZE, MultiRankError, run_on_ranks

__all__ = ["MAX_WORLD_SIZE", "MultiRankError", "run_on_ranks"]
