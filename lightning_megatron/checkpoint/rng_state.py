"""Every random-number stream a training run draws from, captured and restored for exact resume."""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

from ..tensor_parallel.random import RNGStatesTracker


def capture_rng_state(tracker: RNGStatesTracker) -> Dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA default generators, and the tp/ep tracker's states."""
    state: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state(), "tracker": tracker.get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any], tracker: RNGStatesTracker) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker.set_states(state["tracker"])
