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


def idle_gaps(prof, steps: int, at_least_us: float = 20.0) -> dict:
    """Where the GPU sat idle (no kernel or copy on any stream): busy and idle ms per step, and the idle time
    between each pair of kernels (before -> after, names cut short) summed over the gaps of at least
    ``at_least_us``: what the GPU waited for (host launches, synchronisations, the data loader)."""
    kernels = gpu_kernels(prof)
    if not kernels:
        return {}
    busy, end, last, gaps = 0.0, kernels[0][1], kernels[0][0], {}
    for name, start, stop in kernels:
        if start - end >= at_least_us:
            pair = f"{last[:45]} -> {name[:45]}"
            count, total = gaps.get(pair, (0, 0.0))
            gaps[pair] = (count + 1, total + (start - end))
        if stop > end:
            busy += stop - max(start, end)
            end, last = stop, name
    span = kernels[-1][2] - kernels[0][1]
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:12]
    return {"busy_ms": round(busy / 1e3 / steps, 2), "idle_ms": round((span - busy) / 1e3 / steps, 2),
            "idle_gaps_ms (count, ms per step)": {k: (c // steps, round(t / 1e3 / steps, 2)) for k, (c, t) in top}}


def kernel_ms_by_name(prof, steps: int, top: int = 25, width: int = 60) -> dict:
    """GPU milliseconds per step of the ``top`` kernels (names cut to ``width``, summed over each name): to
    compare two configurations kernel by kernel, e.g. which kernels a concurrent collective slows down."""
    totals: dict = {}
    for name, start, stop in gpu_kernels(prof):
        totals[name[:width]] = totals.get(name[:width], 0.0) + (stop - start)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {name: round(us / 1e3 / steps, 2) for name, us in ranked}


def cuda_api_by_thread(prof, top: int = 8) -> dict:
    """Per host thread, the CUDA runtime/driver calls that took longest in total under ``prof``: ``{thread:
    {call: (count, total ms, longest ms)}}``. A call that waits for another thread's work (a copy engine, a
    lock in the driver) shows here as long launches or copies on the thread that waited."""
    calls: dict = {}
    for event in prof.events():
        if event.device_type.name != "CPU" or not event.name.startswith("cu"):
            continue
        ms = (event.time_range.end - event.time_range.start) / 1e3
        count, total, longest = calls.setdefault(event.thread, {}).get(event.name, (0, 0.0, 0.0))
        calls[event.thread][event.name] = (count + 1, total + ms, max(longest, ms))
    return {thread: {name: (c, round(t, 2), round(m, 2))
                     for name, (c, t, m) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]}
            for thread, by_name in calls.items()}
