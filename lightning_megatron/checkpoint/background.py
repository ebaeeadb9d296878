"""Checkpoint saves written by a thread while training goes on; one save in flight at a time.

The calling thread does what must happen at the save's point in training: it collects the tensors and objects,
snapshots them (``stage.py``: clones on the GPU when they fit, else copies to host memory), agrees with the other
ranks and creates the staging folder. The thread moves the clones to host memory, writes the shards and commits
the folder (``SaveJob.write``): its collectives run on a gloo group of its own over
the whole world, created once, so they never interleave with the training's on the same group. The folder still
becomes visible only when every rank finished writing (``folder.py``); a process killed mid-write leaves only the
``.incomplete`` folder. The next save, ``wait()`` and ``close()`` wait for the write and raise its error; work
deferred with ``after_save`` (deleting an older checkpoint) runs only once the save committed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from .collective import agree, distributed
from .entries import Modules
from .errors import CheckpointError
from .sharded import Optimizers, SaveJob, collect_save, prepare_save
from .stage import reserve, to_host


class BackgroundSaver:
    """``save`` returns once the state is copied to host memory; the shards are written in a thread."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._path = ""
        self._after: List[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._buffers: Dict[str, torch.Tensor] = {}
        self._group: Any = None
        self._world: Any = None   # the default group the write group was made for
        self._peak_floor = 0      # the GPU's peak allocation before the last save's clones
        self._cloned_bytes = 0    # what the last save's clones held (counted in the peak since)

    def save(self, path: Union[str, os.PathLike], model_modules: Modules, optimizers: Optimizers = None,
             extra_state: Any = None, *, rank_state: Any = None, checksums: bool = False) -> None:
        """Like ``save_sharded`` (collective), but the write goes on in the background. Raises the error of the
        previous background save, if it failed."""
        self.wait()
        landings: List[Callable[[], List[Any]]] = []

        def stage(entries: List[Any], blobs: Dict[str, Any]) -> Any:
            snapshot = to_host(entries, blobs, self._buffers, self._training_peak(entries))
            landings.append(snapshot.land)
            self._cloned_bytes = snapshot.cloned_bytes
            return entries, snapshot.pickled

        job = prepare_save(path, model_modules, optimizers, extra_state, rank_state=rank_state, checksums=checksums,
                           stage=stage)
        group = self._write_group()
        self._path, self._after = job.path, []
        self._thread = threading.Thread(target=self._write, args=(job, group, landings[0]), daemon=True,
                                        name=f"lightning-megatron checkpoint {job.path}")
        self._thread.start()

    def reserve(self, model_modules: Modules, optimizers: Optimizers = None) -> None:
        """Make the host buffers the saves of this state will use (pinned for GPU tensors) now, at a point where a
        stall is expected (after the first optimizer step), not at the first save. Not collective."""
        self.wait()
        reserve(collect_save(model_modules, optimizers)[0], self._buffers)

    def _training_peak(self, entries: List[Any]) -> Optional[int]:
        """The most GPU memory training allocated, less the last save's clones, which the allocator's peak may
        count: the larger of the peak before them and the peak since less their size."""
        if not any(entry.local.is_cuda for entry in entries):
            return None
        peak = torch.cuda.max_memory_allocated()
        estimate = max(self._peak_floor, peak - self._cloned_bytes)
        self._peak_floor = estimate
        return estimate

    def after_save(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the save in flight has committed (now if none is): an older checkpoint must stay
        until the new one is whole. Dropped if that save fails."""
        with self._lock:
            if self._thread is not None:
                self._after.append(work)
                return
        work()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (once), on every rank alike."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"the background save of {self._path} failed ({type(error).__name__}: {error}); "
                                  f"the previous checkpoint is intact.") from error

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and let go of the host buffers and the write group."""
        try:
            self.wait()
        finally:
            self._buffers = {}
            if self._group is not None and distributed() and dist.group.WORLD is self._world:
                dist.destroy_process_group(self._group)
            self._group = self._world = None

    def _write(self, job: SaveJob, group: Any, land: Callable[[], List[Any]]) -> None:
        try:
            dataclasses.replace(job, entries=land()).write(group)
        except BaseException as err:  # noqa: BLE001 - raised by the next save, wait() or close()
            self._error = err
        with self._lock:
            after, self._after = self._after, []
            if self._error is None:
                for work in after:
                    try:
                        work()
                    except Exception as err:  # noqa: BLE001 - likewise
                        self._error = err
                        break
            self._thread = None if self._error is None else self._thread

    def _write_group(self) -> Any:
        """A gloo group over the whole world for the writing thread's collectives (made once per world; collective)."""
        if not distributed():
            return None
        if self._group is None or dist.group.WORLD is not self._world:
            error = None
            try:
                self._group, self._world = dist.new_group(backend="gloo"), dist.group.WORLD
            except Exception as err:  # noqa: BLE001 - agreed on: no rank writes without the others
                error = err
            agree(error)
        return self._group
