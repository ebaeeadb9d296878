"""A snapshot of what a background save writes: training may change the originals while it is written.

What must happen at the save's point in training (the calling thread) is kept to the least: objects are pickled,
CPU tensors copied, and GPU tensors copied **on the GPU** (a device-to-device clone, milliseconds even for
gigabytes) when the card has room for them beside the training's peak. The writing thread then copies the clones
into pinned host buffers on a stream of its own while training goes on, and frees them once they landed. Without
room for the clones the GPU tensors are copied to the host buffers on the current stream, as part of the next step
(which then waits for the copy).

Host buffers are kept from one save to the next, by key. The pinned ones are made by the calling thread
(``cudaHostAlloc``: seconds for gigabytes, once), ahead of the first save where the strategy can (``reserve``, after
the first optimizer step) or else at it: made in the writing thread they stalled the training thread's CUDA calls as
long (GPT-1.3B on an H200: the step after the first save took 36x its time), and pageable buffers, filled at a few
GB/s, kept the copies going for seconds. The writing thread copies in slices of ``LAND_CHUNK_BYTES``, one slice in
flight at a time, so a copy engine is never queued up for long with its gigabytes: the steps after a save with the
clones copied whole took 1.4-7x their time (not profiled yet; a training-side transfer waiting behind them is the
suspect).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from .entries import Entry
from .planner import Pickled

#: GPU memory kept free beside the step's own peak when deciding whether the clones fit
HEADROOM_BYTES = 1 << 30
#: the most bytes the writing thread has in flight from GPU clones to host buffers
LAND_CHUNK_BYTES = 64 << 20


class Snapshot(NamedTuple):
    """``land()``, called in the writing thread, returns the entries as host copies once they are there;
    ``pickled``: the objects, pickled at the save's point; ``cloned_bytes``: GPU memory the clones hold until
    they landed (0 without clones)."""

    land: Callable[[], List[Entry]]
    pickled: Dict[str, Any]
    cloned_bytes: int


def to_host(entries: List[Entry], blobs: Dict[str, Any], buffers: Dict[str, torch.Tensor],
            training_peak: Optional[int] = None) -> Snapshot:
    """Snapshot ``entries`` (into host ``buffers``, reused by key) and ``blobs``. ``training_peak``: the most GPU
    memory training has allocated (default ``torch.cuda.max_memory_allocated``; pass an estimate without earlier
    saves' clones, which that peak may include)."""
    pickled = {key: value if isinstance(value, Pickled) else Pickled.of(value) for key, value in blobs.items()}
    keys = {entry.key for entry in entries}
    for key in [k for k in buffers if k not in keys]:
        del buffers[key]   # a tensor the model no longer has
    on_gpu = [entry for entry in entries if entry.local.is_cuda]
    if not on_gpu:
        staged = [_host_entry(entry, entry.local.detach(), buffers, non_blocking=False) for entry in entries]
        return Snapshot(lambda: staged, pickled, 0)
    device = on_gpu[0].local.device
    nbytes = sum(e.local.numel() * e.local.element_size() for e in on_gpu)
    if _clones_fit(nbytes, device, training_peak):
        return Snapshot(_land_clones(entries, buffers, device), pickled, nbytes)
    staged = [_host_entry(entry, entry.local.detach(), buffers, non_blocking=entry.local.is_cuda)
              for entry in entries]
    copied = torch.cuda.Event()
    copied.record()   # the copies are queued on the current stream: the next step cannot change them first

    def land() -> List[Entry]:
        copied.synchronize()
        return staged
    return Snapshot(land, pickled, 0)


def _land_clones(entries: List[Entry], buffers: Dict[str, torch.Tensor],
                 device: torch.device) -> Callable[[], List[Entry]]:
    """Clone the GPU tensors on the current stream now and make sure their pinned host buffers exist (CPU tensors
    are copied now); the returned function copies the clones into the buffers on a stream of its own and lets the
    clones go."""
    clones: Dict[str, torch.Tensor] = {}
    staged: List[Entry] = []
    for entry in entries:
        source = entry.local.detach()
        if source.is_cuda:
            clones[entry.key] = source.clone()
            _host_buffer(entry.key, source, buffers)
            staged.append(entry)
        else:
            staged.append(_host_entry(entry, source, buffers, non_blocking=False))
    cloned = torch.cuda.Event()
    cloned.record()

    def land() -> List[Entry]:
        stream = torch.cuda.Stream(device)
        stream.wait_event(cloned)
        landed = []
        for entry in staged:
            clone = clones.pop(entry.key, None)
            if clone is None:
                landed.append(entry)
                continue
            target = _host_buffer(entry.key, clone, buffers)
            _copy_in_slices(target, clone, stream)
            del clone   # back to the allocator: its copy is done, so training may reuse the memory
            landed.append(Entry(entry.key, entry.placement, [target]))
        return landed
    return land


def _copy_in_slices(target: torch.Tensor, source: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy GPU ``source`` into pinned host ``target`` on ``stream``, ``LAND_CHUNK_BYTES`` at a time, waiting for
    each slice before the next is queued."""
    with torch.cuda.stream(stream):
        if not (source.is_contiguous() and target.is_contiguous()):
            target.copy_(source, non_blocking=True)   # strided (rare): whole
            stream.synchronize()
            return
        flat_source, flat_target = source.view(-1), target.view(-1)
        step = max(LAND_CHUNK_BYTES // max(source.element_size(), 1), 1)
        for start in range(0, flat_source.numel(), step):
            flat_target[start:start + step].copy_(flat_source[start:start + step], non_blocking=True)
            stream.synchronize()


def reserve(entries: List[Entry], buffers: Dict[str, torch.Tensor]) -> None:
    """Make the host buffers of ``entries`` now (pinned for GPU tensors) so that no save pays for them."""
    for entry in entries:
        _host_buffer(entry.key, entry.local, buffers)


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.shape == source.shape and buffer.dtype == source.dtype


def _host_buffer(key: str, source: torch.Tensor, buffers: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The host buffer kept for ``key``, made (pinned for a GPU source) if missing or of another shape/dtype."""
    target = buffers.get(key)
    if target is None or not _fits(target, source):
        target = buffers[key] = torch.empty_like(source, device="cpu", pin_memory=source.is_cuda)
    return target


def _host_entry(entry: Entry, source: torch.Tensor, buffers: Dict[str, torch.Tensor], *,
                non_blocking: bool) -> Entry:
    """``entry`` holding a host copy of ``source`` (in its buffer of ``buffers``)."""
    target = _host_buffer(entry.key, source, buffers)
    target.copy_(source, non_blocking=non_blocking)
    return Entry(entry.key, entry.placement, [target])


def _clones_fit(nbytes: int, device: torch.device, training_peak: Optional[int] = None) -> bool:
    """Whether clones of ``nbytes`` fit on ``device`` beside the training's peak and a margin: the free memory
    plus what the allocator holds unused, less what training still allocates at its peak."""
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    unused_reserved = torch.cuda.memory_reserved(device) - allocated
    peak = torch.cuda.max_memory_allocated(device) if training_peak is None else training_peak
    step_growth = max(peak - allocated, 0)
    return nbytes + HEADROOM_BYTES <= free + unused_reserved - step_growth
