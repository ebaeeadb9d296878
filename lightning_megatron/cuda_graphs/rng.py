"""RNG for captured regions: which generators a graph registers, and undoing what a capture drew.

Dropout inside a CUDA graph draws from the generator state registered with the graph; each
replay advances that state by what the graph consumed, exactly like the eager kernels would.
The default CUDA generator is registered by ``torch.cuda.graph`` itself; the RNG tracker's
named states (tensor-parallel dropout under ``fork()``) must be generators swapped by pointer
(``RNGStatesTracker.enable_graph_safe``) and registered too.

Capturing runs the code once more than eager training would (warm-up passes on sample inputs;
the eager backend even executes the capture): :func:`preserved_rng` puts every stream back, so
losses with graphs equal eager losses with dropout on.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch

from ..tensor_parallel.random import RNGStatesTracker


def prepare_tracker(tracker: Optional[RNGStatesTracker], backend: str) -> List[torch.Generator]:
    """Make ``tracker`` graph-safe for the CUDA backend and return the generators to register."""
    if tracker is None or backend != "cuda":
        return []
    tracker.enable_graph_safe()
    return tracker.graph_generators()


@contextmanager
def preserved_rng(tracker: Optional[RNGStatesTracker]) -> Iterator[None]:
    """Restore the CPU, current CUDA and tracker streams on exit (in place: registrations survive)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    tracked: Dict[str, torch.Tensor] = tracker.get_states() if tracker is not None else {}
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        if tracker is not None:
            tracker.set_states(tracked)
