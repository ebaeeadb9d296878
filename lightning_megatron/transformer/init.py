"""Initialisation that depends on what a parameter is, not on where or in which order it is built."""

from __future__ import annotations

import contextlib
import zlib
from typing import Iterator

import torch


@contextlib.contextmanager
def seeded(base_seed: int, *keys: object) -> Iterator[None]:
    """Draw from a CPU generator seeded by ``(base_seed, keys)``; restore the caller's state after.

    Layer ``i`` gets ``seeded(seed, "layer", i)`` on whichever pipeline stage builds it, so PP=4
    and PP=1 hold the same weights, and building a model does not shift the user's RNG stream.
    """
    key = zlib.crc32(repr(keys).encode())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((base_seed * 1_000_003 + key) % (2**63))
        yield
