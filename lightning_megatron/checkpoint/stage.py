"""A snapshot of what a background save writes: training may change the originals while it is written.

What must happen at the save's point in training (the calling thread) is kept to a few calls: objects are
pickled, CPU tensors copied into the host slab (``host_slab.py``), and the GPU tensors copied **on the GPU** into
one block laid out as the slab's GPU range (one ``cat`` per dtype, milliseconds even for gigabytes) when the card
has room for it beside the training's peak. The writing thread then copies that block into the pinned slab in one
transfer on a stream of its own while training goes on, and frees it. Without room for the block the GPU tensors
are copied into the slab on the current stream, as part of the next step (which then waits for the copy).

The slab is made ahead of the first save where the strategy can (``reserve``, after the first optimizer step):
pinning gigabytes takes seconds, which no save should pay (GPT-1.3B on an H200: the step after a save that pinned
its buffers took 30-48x its time).
"""

from __future__ import annotations

import functools
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


def to_host(entries: List[Entry], blobs: Dict[str, Any], slab: HostSlab,
            training_peak: Optional[int] = None) -> Snapshot:
    """Snapshot ``entries`` (into ``slab``, which must place them: ``slab_for``) and ``blobs``. ``training_peak``: the most GPU
    memory training has allocated (default ``torch.cuda.max_memory_allocated``; pass an estimate without earlier
    saves' blocks, which that peak may include)."""
    pickled = {key: value if isinstance(value, Pickled) else Pickled.of(value) for key, value in blobs.items()}
    staged = slab.layout.entries(slab)
    on_gpu = [entry for entry in entries if entry.local.is_cuda]
    on_cpu = [entry for entry in entries if not entry.local.is_cuda]
    copy_cpu = functools.partial(_copy, [slab.view(e.key) for e in on_cpu], [e.local.detach() for e in on_cpu])
    copy_cpu()   # at the save's point: training changes these tensors once the call returns
    if not on_gpu:
        return Snapshot(lambda: None, staged, pickled, 0)
    device = on_gpu[0].local.device
    sources = [entry.local.detach() for entry in on_gpu]
    layout = slab.layout
    if _clones_fit(layout.gpu_bytes, device, training_peak):
        return Snapshot(_land_block(layout, sources, on_gpu, slab, device), staged, pickled, layout.gpu_bytes)
    _copy([slab.view(entry.key) for entry in on_gpu], sources, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()   # the copies are queued on the current stream: the next step cannot change them first
    return Snapshot(copied.synchronize, staged, pickled, 0)


def _land_block(layout: Layout, sources: List[torch.Tensor], on_gpu: List[Entry], slab: HostSlab,
                device: torch.device) -> Callable[[], None]:
    """Copy the GPU tensors into one GPU block laid out as the slab's GPU range (one ``cat`` per dtype run, on the
    current stream) now; the returned function copies the block into the slab on a stream of its own and lets it
    go."""
    block = torch.empty(layout.gpu_bytes, dtype=torch.uint8, device=device)
    by_key = {entry.key: source for entry, source in zip(on_gpu, sources)}
    for run in layout.gpu_runs:
        torch.cat([by_key[key].reshape(-1) for key in run.keys], out=block[run.start:run.end].view(run.dtype))
    cloned = torch.cuda.Event()
    cloned.record()
    held = [block]

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
