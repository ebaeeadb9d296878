"""Nested containers of tensors (batches, step results): map, list and compare their leaves.

Containers: tuple (named tuples too), list, dict, dataclass instances. Anything else is a leaf.
A *signature* records what a graph baked in: each tensor's shape, dtype, device and
``requires_grad``, and every other leaf's value, so a replay can refuse inputs it was not
captured for and say which leaf differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

Path = str


def _children(obj: Any) -> Optional[List[Tuple[str, Any]]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def _rebuild(obj: Any, values: List[Any]) -> Any:
    if isinstance(obj, dict):
        return type(obj)(zip(obj.keys(), values))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*values)
    if isinstance(obj, (list, tuple)):
        return type(obj)(values)
    return dataclasses.replace(obj, **{f.name: v for f, v in zip(dataclasses.fields(obj), values)
                                       if f.init})


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor leaf replaced by ``fn(leaf)``; containers are rebuilt, other leaves kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    children = _children(obj)
    if children is None:
        return obj
    return _rebuild(obj, [map_tensors(fn, v) for _, v in children])


def leaves(obj: Any, path: Path = "") -> List[Tuple[Path, Any]]:
    """``(path, leaf)`` pairs in a fixed order (``path`` reads like ``[0]['input_ids']``)."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    children = _children(obj)
    if children is None:
        return [(path, obj)]
    out: List[Tuple[Path, Any]] = []
    for name, value in children:
        out.extend(leaves(value, path + name))
    return out


def tensors_of(obj: Any) -> List[torch.Tensor]:
    return [leaf for _, leaf in leaves(obj) if isinstance(leaf, torch.Tensor)]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def __str__(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return f"tensor{list(self.shape)} {self.dtype} on {self.device}{grad}"


def signature(obj: Any) -> Tuple[Tuple[Path, Any], ...]:
    """What a capture depends on: container layout, tensor specs, other leaves' values."""
    return tuple((path, TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else _Value(leaf))
                 for path, leaf in leaves(obj))


class _Value:
    """A non-tensor leaf, compared by ``==`` (identity when that fails)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Value):
            return NotImplemented
        try:
            return bool(self.value == other.value)
        except Exception:
            return self.value is other.value

    def __hash__(self) -> int:
        return 0

    def __str__(self) -> str:
        return repr(self.value)

    __repr__ = __str__


def first_difference(captured: Tuple[Tuple[Path, Any], ...], now: Tuple[Tuple[Path, Any], ...]) -> str:
    """A sentence naming the first leaf where two signatures differ."""
    for (p_old, old), (p_new, new) in zip(captured, now):
        if p_old != p_new:
            return f"the structure changed at {p_old or '<root>'} (now {p_new or '<root>'})"
        if old != new:
            return f"{p_old or '<root>'} was {old} at capture, now {new}"
    if len(captured) != len(now):
        return f"the structure changed: {len(captured)} leaves at capture, {len(now)} now"
    return "no difference"
