"""A snapshot of what a background save writes: training may change the originals while it is written.

What must happen at the save's point in training (the calling thread) is kept to a few calls: objects are
pickled, CPU tensors copied into the host slab (``host_slab.py``), and the GPU tensors copied **on the GPU** into
one block laid out as the slab's GPU range (one ``_foreach_copy_`` per dtype, milliseconds even for gigabytes) when
the card has room for it beside the training's peak. The writing thread then copies that block into the pinned slab in one
transfer on a stream of its own while training goes on, and frees it. Without room for the block the GPU tensors
are copied into the slab on the current stream, as part of the next step (which then waits for the copy).

The slab is made ahead of the first save where the strategy can (``reserve``, after the first optimizer step):
pinning gigabytes takes seconds, which no save should pay (GPT-1.3B on an H200: the step after a save that pinned
its buffers took 30-48x its time).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from .entries import Entry
from .host_slab import HostSlab, Layout, layout_of
from .planner import Pickled

#: GPU memory kept free beside the step's own peak when deciding whether the GPU block fits
HEADROOM_BYTES = 1 << 30


class Snapshot(NamedTuple):
    """``land()``, called in the writing thread, returns once the slab holds every entry; ``entries``: the entries
    over the slab's views; ``pickled``: the objects, pickled at the save's point; ``cloned_bytes``: GPU memory the
    block holds until it landed (0 without it)."""

    land: Callable[[], None]
    entries: List[Entry]
    pickled: Dict[str, Any]
    cloned_bytes: int


def slab_for(entries: List[Entry], slab: Optional[HostSlab]) -> HostSlab:
    """``slab`` if it places exactly ``entries``, else a new one (pinned for a GPU state); the old one is closed."""
    if slab is not None and slab.layout.matches(entries):
        return slab
    if slab is not None:
        slab.close()
    layout = layout_of(entries)
    return HostSlab(layout, pin=layout.gpu_bytes > 0 and torch.cuda.is_available())


class CopyPlan(NamedTuple):
    """What a snapshot of ``entries`` into a slab copies, worked out once while they stay the same tensors:
    ``staged``, the entries over the slab's views; the CPU tensors and their slab views; the GPU tensors and their
    slab views; per run of the layout, its tensors (flat views where contiguous: views, never copies, since the plan
    outlives the call), their sizes, and which of them keep their shape (not contiguous)."""

    staged: List[Entry]
    cpu_targets: List[torch.Tensor]
    cpu_sources: List[torch.Tensor]
    gpu_targets: List[torch.Tensor]
    gpu_sources: List[torch.Tensor]
    run_sources: List[List[torch.Tensor]]
    run_sizes: List[List[int]]
    run_shaped: List[List[int]]


def plan_copies(entries: List[Entry], slab: HostSlab) -> CopyPlan:
    """The copies that snapshot ``entries`` into ``slab`` (which must place them: ``slab_for``)."""
    on_gpu = [entry for entry in entries if entry.local.is_cuda]
    on_cpu = [entry for entry in entries if not entry.local.is_cuda]
    by_key = {entry.key: entry.local.detach() for entry in on_gpu}
    runs = [[by_key[key] for key in run.keys] for run in slab.layout.gpu_runs]
    return CopyPlan(slab.layout.entries(slab), [slab.view(e.key) for e in on_cpu], [e.local.detach() for e in on_cpu],
                    [slab.view(e.key) for e in on_gpu], list(by_key.values()),
                    [[t.view(-1) if t.is_contiguous() else t for t in tensors] for tensors in runs],
                    [[t.numel() for t in tensors] for tensors in runs],
                    [[i for i, t in enumerate(tensors) if not t.is_contiguous()] for tensors in runs])


def to_host(entries: List[Entry], blobs: Dict[str, Any], slab: HostSlab,
            training_peak: Optional[int] = None, plan: Optional[CopyPlan] = None) -> Snapshot:
    """Snapshot ``entries`` (into ``slab``, which must place them: ``slab_for``) and ``blobs``. ``training_peak``: the most GPU
    memory training has allocated (default ``torch.cuda.max_memory_allocated``; pass an estimate without earlier
    saves' blocks, which that peak may include); ``plan``: ``plan_copies(entries, slab)`` if already made."""
    plan = plan or plan_copies(entries, slab)
    land: Callable[[], None] = _nothing
    cloned_bytes = 0
    if plan.gpu_sources:   # first: the GPU copies while the host pickles
        device = plan.gpu_sources[0].device
        layout = slab.layout
        if _clones_fit(layout.gpu_bytes, device, training_peak):
            land, cloned_bytes = _land_block(layout, plan, slab, device), layout.gpu_bytes
        else:
            _copy(plan.gpu_targets, plan.gpu_sources, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()   # the copies are queued on the current stream: the next step cannot change them first
            land = copied.synchronize
    _copy(plan.cpu_targets, plan.cpu_sources)   # at the save's point: training changes these once the call returns
    pickled = {key: value if isinstance(value, Pickled) else Pickled.of(value) for key, value in blobs.items()}
    return Snapshot(land, plan.staged, pickled, cloned_bytes)


def _nothing() -> None:
    pass


def warm_block(plan: CopyPlan, slab: HostSlab, training_peak: Optional[int] = None) -> int:
    """Do a save's copies once, ahead of it (``reserve``): the CPU tensors into the slab (its pages are touched now,
    not at the first save), and the GPU tensors into a GPU block let go at once: the allocator keeps its memory, so
    the first save neither allocates gigabytes nor loads the copy kernels while training waits. Returns the bytes
    the block held (0 when it does not fit or nothing is on a GPU)."""
    _copy(plan.cpu_targets, plan.cpu_sources)
    if not plan.gpu_sources:
        return 0
    device = plan.gpu_sources[0].device
    if not _clones_fit(slab.layout.gpu_bytes, device, training_peak):
        return 0
    _fill_block(slab.layout, plan, device)
    return slab.layout.gpu_bytes


def _fill_block(layout: Layout, plan: CopyPlan, device: torch.device) -> torch.Tensor:
    """One GPU block laid out as the slab's GPU range, filled on the current stream: each run split into its tensors'
    views and copied into with one ``_foreach_copy_`` (a few batched kernels; ``cat`` copies large inputs one
    kernel each, 7 ms of launches for GPT-1.3B's 1168 tensors)."""
    block = torch.empty(layout.gpu_bytes, dtype=torch.uint8, device=device)
    for run, sources, sizes, shaped in zip(layout.gpu_runs, plan.run_sources, plan.run_sizes, plan.run_shaped):
        targets = list(block[run.start:run.end].view(run.dtype).split(sizes))
        for i in shaped:
            targets[i] = targets[i].view(sources[i].shape)
        _copy(targets, sources)
    return block


def _land_block(layout: Layout, plan: CopyPlan, slab: HostSlab, device: torch.device) -> Callable[[], None]:
    """Copy the GPU tensors into one GPU block (``_fill_block``) now; the returned function copies the block into the
    slab on a stream of its own and lets it go."""
    held = [_fill_block(layout, plan, device)]
    cloned = torch.cuda.Event()
    cloned.record()

    def land() -> None:
        stream = torch.cuda.Stream(device)
        stream.wait_event(cloned)
        assert slab.bytes is not None
        with torch.cuda.stream(stream):
            slab.bytes[:layout.gpu_bytes].copy_(held[0], non_blocking=True)
        stream.synchronize()
        held.clear()   # back to the allocator: its copy is done, so training may reuse the memory
    return land


def _copy(targets: List[torch.Tensor], sources: List[torch.Tensor], non_blocking: bool = False) -> None:
    """``targets[i].copy_(sources[i])`` for all, in one call (the loop runs in C++)."""
    if targets:
        torch._foreach_copy_(targets, sources, non_blocking=non_blocking)


def _clones_fit(nbytes: int, device: torch.device, training_peak: Optional[int] = None) -> bool:
    """Whether a block of ``nbytes`` fits on ``device`` beside the training's peak and a margin: the free memory
    plus what the allocator holds unused, less what training still allocates at its peak."""
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    unused_reserved = torch.cuda.memory_reserved(device) - allocated
    peak = torch.cuda.max_memory_allocated(device) if training_peak is None else training_peak
    step_growth = max(peak - allocated, 0)
    return nbytes + HEADROOM_BYTES <= free + unused_reserved - step_growth
