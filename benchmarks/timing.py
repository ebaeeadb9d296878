"""Median milliseconds of a callable on the GPU (CUDA events) or the CPU (wall clock)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

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
