"""Median milliseconds of a callable on the GPU (CUDA events) or the CPU (wall clock); GPU busy time from a
profile."""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Tuple

import torch


def timed(fn: Callable[[], None], iters: int, warmup: int, device: torch.device, gpu_only: bool = False) -> float:
    """Median milliseconds of ``fn``. ``gpu_only``: a GPU sleep queued first lets the host launch everything
    before the start event runs, so the time leaves out host launch overhead."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if gpu_only:
                torch.cuda._sleep(20_000_000)        # ~10 ms: longer than launching one step
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_kernels(prof, skip: Tuple[str, ...] = ()) -> List[Tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every kernel and copy the GPU ran under ``prof`` (a finished
    ``torch.profiler.profile``), each once, without names containing any of ``skip`` (e.g. ``"nccl"``).

    User annotations are left out: the profiler mirrors ``record_function`` ranges onto the GPU timeline, and
    Lightning's ``Optimizer.step#AdamW.step`` spans the whole step (its closure runs forward and backward), so
    counting it made every step look busy (a sum over ``key_averages()`` gave twice the step time)."""
    seen = {(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
            and not any(word in e.name.lower() for word in skip)}
    return sorted(seen, key=lambda k: k[1])


def gpu_busy_ms(prof, steps: int, skip: Tuple[str, ...] = ()) -> float:
    """Milliseconds per step the GPU was busy (the union of the kernels' intervals: overlapping streams count
    once)."""
    busy_us, end = 0.0, float("-inf")
    for _, start, stop in gpu_kernels(prof, skip):
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    return busy_us / steps / 1e3
