"""One block of host memory holding a whole training state for background saves, at fixed offsets per tensor.

The block is an anonymous shared mapping (``memfd``): the writing process maps the same pages, so a save hands it
nothing but names and places. It is pinned (``cudaHostRegister``) when the state lives on a GPU, so the copy to it
is one asynchronous transfer. GPU tensors come first in the layout: their bytes form one range, which a save clones
on the GPU and copies to the host in one piece.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

from .entries import Entry
from .placement import Placement

#: every CPU tensor and every run of GPU tensors starts at a multiple of this many bytes (any dtype's alignment)
ALIGN = 256


class Slot(NamedTuple):
    """Where one tensor's bytes lie, and its placement in the global tensor (what the writer stores it as: fixed for
    the life of a saver, whose parallel layout does not change)."""

    offset: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    on_gpu: bool
    placement: Placement

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


class Run(NamedTuple):
    """GPU tensors of one dtype packed back to back in ``[start, end)``, in the order of ``keys``: one copy fills
    them all (one ``_foreach_copy_`` into the run split into their views)."""

    dtype: torch.dtype
    start: int
    end: int
    keys: Tuple[str, ...]


class Layout(NamedTuple):
    """Where each key's bytes lie (``slots``, in the order of the entries it was made for); ``gpu_bytes``: the
    length of the leading range that holds the GPU tensors, in ``gpu_runs``."""

    slots: Dict[str, Slot]
    nbytes: int
    gpu_bytes: int
    gpu_runs: Tuple[Run, ...]

    def entries(self, block: "HostSlab") -> List[Entry]:
        """The entries this layout places, over ``block``'s views: what a save of them writes."""
        return [Entry(key, slot.placement, [block.view(key)]) for key, slot in self.slots.items()]

    def matches(self, entries: Iterable[Entry]) -> bool:
        """Whether ``entries`` are exactly the tensors this layout places (same keys, shapes, dtypes, devices)."""
        entries = list(entries)
        return len(entries) == len(self.slots) and all(
            (slot := self.slots.get(e.key)) is not None and slot.shape == tuple(e.local.shape)
            and slot.dtype == e.local.dtype and slot.on_gpu == e.local.is_cuda for e in entries)


def layout_of(entries: Iterable[Entry]) -> Layout:
    """GPU tensors first, packed in one run per dtype (each run ``ALIGN``-ed), then the others, each ``ALIGN``-ed."""
    entries = list(entries)
    slots: Dict[str, Slot] = {}
    runs = []
    offset = 0
    on_gpu = [e for e in entries if e.local.is_cuda]
    for dtype in dict.fromkeys(e.local.dtype for e in on_gpu):
        start = offset
        keys = tuple(e.key for e in on_gpu if e.local.dtype == dtype)
        for entry in (e for e in on_gpu if e.local.dtype == dtype):
            slots[entry.key] = slot = Slot(offset, tuple(entry.local.shape), dtype, True, entry.placement)
            offset += slot.nbytes
        runs.append(Run(dtype, start, offset, keys))
        offset = _aligned(offset)
    gpu_bytes = offset
    for entry in (e for e in entries if not e.local.is_cuda):
        slots[entry.key] = slot = Slot(offset, tuple(entry.local.shape), entry.local.dtype, False, entry.placement)
        offset = _aligned(offset + slot.nbytes)
    return Layout({e.key: slots[e.key] for e in entries}, offset, gpu_bytes, tuple(runs))


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def view(block: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``slot``'s tensor inside ``block`` (bytes, host or GPU)."""
    return block[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class HostSlab:
    """The host block of a ``Layout``: ``bytes`` (uint8) over a shared mapping, ``fd`` its file descriptor."""

    def __init__(self, layout: Layout, *, fd: Optional[int] = None, pin: bool = False) -> None:
        self.layout = layout
        size = max(layout.nbytes, ALIGN)
        if fd is None:
            fd = _anonymous_file(size)
        self.fd = fd
        self._map: Optional[mmap.mmap] = mmap.mmap(fd, size)
        self.bytes: Optional[torch.Tensor] = torch.frombuffer(self._map, dtype=torch.uint8)
        self._views: Dict[str, torch.Tensor] = {}   # made once: a save's call asks for every one of them
        self.pinned = False
        if pin:
            from torch.cuda._pin_memory_utils import pin_memory
            pin_memory(self.bytes.data_ptr(), size)   # page-locked: copies from the GPU run asynchronously
            self.pinned = True

    def view(self, key: str) -> torch.Tensor:
        found = self._views.get(key)
        if found is None:
            assert self.bytes is not None, "the slab was closed"
            found = self._views[key] = view(self.bytes, self.layout.slots[key])
        return found

    def close(self) -> None:
        """Unpin, let go of the mapping and close the descriptor. The memory is unmapped once no tensor views it any
        more (``torch.frombuffer`` holds the mapping; closing it under a live view would leave the view dangling)."""
        if self.bytes is None:
            return
        if self.pinned:
            from torch.cuda._pin_memory_utils import unpin_memory
            unpin_memory(self.bytes.data_ptr())
        self.bytes, self._map, self._views = None, None, {}
        os.close(self.fd)


def _anonymous_file(size: int) -> int:
    """A descriptor of ``size`` bytes of memory no path names: ``memfd`` (Linux), else an unlinked temporary file."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("lightning-megatron-checkpoint", os.MFD_CLOEXEC)
    else:   # pragma: no cover - not Linux
        handle, name = tempfile.mkstemp(prefix="lightning-megatron-checkpoint-")
        os.unlink(name)
        fd = handle
    os.ftruncate(fd, size)
    return fd
