"""Argument checks shared by the pure pipeline modules: errors name the parameter and a fix."""

from __future__ import annotations

from typing import Callable, List

from .topology import ParallelConfigError


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum`` (not a bool), else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParallelConfigError(
            f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})."
        )
    if value < minimum:
        raise ParallelConfigError(f"{name} must be >= {minimum}, got {value}.")
    return value


def check_rank(name: str, value: object, size_name: str, size: int) -> int:
    """Return ``value`` if it is a valid index into a group of ``size``."""
    value = check_int(name, value, minimum=0)
    if value >= size:
        raise ParallelConfigError(
            f"{name}={value} is out of range for {size_name}={size}; "
            f"valid values are 0..{size - 1}."
        )
    return value


def nearest(ok: Callable[[int], bool], around: int, lo: int, hi: int,
            per_side: int = 2) -> List[int]:
    """Up to ``per_side`` values each side of ``around`` in [lo, hi] for which ``ok`` holds."""
    below = [v for v in range(around - 1, lo - 1, -1) if ok(v)][:per_side]
    above = [v for v in range(around + 1, hi + 1) if ok(v)][:per_side]
    return sorted(below) + above


def listing(values: List[int]) -> str:
    """``[8, 12]`` -> ``"8, 12"``; an empty list reads as ``"none"``."""
    return ", ".join(str(v) for v in values) if values else "none"
