"""The names things get inside a sharded checkpoint (one flat DCP namespace).

``model.<global name>`` are the model's tensors under their single-process names;
``optimizer.<i>.state.<global name>.<state key>`` optimizer ``i``'s per-parameter state (Adam's
``exp_avg``, ``exp_avg_sq``, ``step``) sharded like its parameter; the rest are small pickled
objects (``optimizer.<i>.param_groups``, ``extra_state``, ``rank_state.<rank>``, ``checkpoint_info``).
"""

from __future__ import annotations

from typing import Optional, Tuple

MODEL = "model."
EXTRA_STATE = "extra_state"
INFO = "checkpoint_info"
FORMAT = "lightning_megatron.sharded/1"


def model_key(name: str) -> str:
    return MODEL + name


def state_prefix(optimizer_index: int) -> str:
    return f"optimizer.{optimizer_index}.state."


def state_key(optimizer_index: int, name: str, key: str) -> str:
    return f"{state_prefix(optimizer_index)}{name}.{key}"


def split_state_key(optimizer_index: int, key: str) -> Optional[Tuple[str, str]]:
    """``(global name, state key)`` of a ``state_key`` of optimizer ``i``; None for other keys."""
    prefix = state_prefix(optimizer_index)
    if not key.startswith(prefix) or "." not in key[len(prefix):]:
        return None
    name, state = key[len(prefix):].rsplit(".", 1)
    return name, state


def param_groups_key(optimizer_index: int) -> str:
    return f"optimizer.{optimizer_index}.param_groups"


def rank_state_key(rank: int) -> str:
    return f"rank_state.{rank}"
