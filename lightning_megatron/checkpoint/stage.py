"""A snapshot of what a save writes, in host memory: training may change the originals while it is written.

Tensors are copied into host buffers kept from one save to the next (pinned when the source is on a GPU, the copies
queued on the current stream, so the step that follows cannot change them first); objects are pickled at once.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from .entries import Entry
from .planner import Pickled


def to_host(entries: List[Entry], blobs: Dict[str, Any],
            buffers: Dict[str, torch.Tensor]) -> Tuple[List[Entry], Dict[str, Any], Callable[[], None]]:
    """Copies of ``entries`` (in ``buffers``, reused by key) and ``blobs`` (pickled), and a function that waits
    until the copies have landed (call it in the writing thread)."""
    staged, on_gpu = [], False
    for entry in entries:
        source = entry.local.detach()
        target = buffers.get(entry.key)
        if target is None or target.shape != source.shape or target.dtype != source.dtype:
            target = torch.empty_like(source, device="cpu", pin_memory=source.is_cuda)
            buffers[entry.key] = target
        target.copy_(source, non_blocking=source.is_cuda)
        on_gpu = on_gpu or source.is_cuda
        staged.append(Entry(entry.key, entry.placement, [target]))
    keys = {entry.key for entry in entries}
    for key in [k for k in buffers if k not in keys]:
        del buffers[key]   # a tensor the model no longer has
    pickled = {key: value if isinstance(value, Pickled) else Pickled.of(value) for key, value in blobs.items()}
    if not on_gpu:
        return staged, pickled, lambda: None
    copied = torch.cuda.Event()
    copied.record()
    return staged, pickled, copied.synchronize
