"""Checkpoint saves written in the background while training goes on; one save in flight at a time.

The calling thread does what must happen at the save's point in training: it collects the tensors and objects,
snapshots them into the host slab (``stage.py``: through one GPU block when it fits, else copies on the current
stream), agrees with the other ranks and creates the staging folder. A thread of this process then waits for the
snapshot's copy to the host and hands the save to the writing process (``writer_process.py``), which writes the
shards and commits the folder with its own Python, so the write never holds this process's GIL. The folder still
becomes visible only when every rank finished writing (``folder.py``); a process killed mid-write leaves only the
``.incomplete`` folder. The next save, ``wait()`` and ``close()`` wait for the write and raise its error; work
deferred with ``after_save`` (deleting an older checkpoint) runs only once the save committed.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from .collective import rank, world_size
from .entries import Modules
from .errors import CheckpointError
from .host_slab import HostSlab
from .sharded import Optimizers, prepare_save
from .stage import CopyPlan, Snapshot, plan_copies, slab_for, to_host, warm_block
from .tensor_cache import TensorCollector
from .writer_process import WriterProcess, job_of, rendezvous


class BackgroundSaver:
    """``save`` returns once the state is snapshotted; the shards are written by another process."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._path = ""
        self._after: List[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._slab: Optional[HostSlab] = None
        self._writer: Optional[WriterProcess] = None
        self._store: Any = None   # rank 0's: the store of the writers' group
        self._peak_floor = 0      # the GPU's peak allocation before the last save's GPU block
        self._cloned_bytes = 0    # what the last save's GPU block held (counted in the peak since)
        self._collect = TensorCollector()   # the entries, collected again only when the tensors changed
        self._plan: Optional[Tuple[List[Any], CopyPlan]] = None   # the copies for those entries into the slab

    def save(self, path: Union[str, os.PathLike], model_modules: Modules, optimizers: Optimizers = None,
             extra_state: Any = None, *, rank_state: Any = None, checksums: bool = False) -> None:
        """Like ``save_sharded`` (collective), but the write goes on in the background. Raises the error of the
        previous background save, if it failed."""
        self.wait()
        snapshots: List[Snapshot] = []

        def stage(entries: List[Any], blobs: dict) -> Any:
            plan = self._plan_for(entries)
            assert self._slab is not None
            snapshot = to_host(entries, blobs, self._slab, self._training_peak(entries), plan)
            snapshots.append(snapshot)
            self._cloned_bytes = snapshot.cloned_bytes
            return snapshot.entries, snapshot.pickled

        job = prepare_save(path, model_modules, optimizers, extra_state, rank_state=rank_state, checksums=checksums,
                           stage=stage, collect=self._collect)
        writer = self._start_writer()
        if not writer.connected:
            address, self._store = rendezvous()
            writer.connect(address)
        assert self._slab is not None
        self._path, self._after = job.path, []
        self._thread = threading.Thread(target=self._write, args=(job, snapshots[0].land, writer, self._slab),
                                        daemon=True, name=f"lightning-megatron checkpoint {job.path}")
        self._thread.start()

    def reserve(self, model_modules: Modules, optimizers: Optimizers = None) -> None:
        """Make the host slab the saves of this state will use (pinned for GPU tensors) and start the writing
        process now, at a point where a stall is expected (after the first optimizer step), not at the first save.
        A GPU block is filled and let go as a save would (``warm_block``): the first save finds its memory in the
        allocator and its kernels loaded. Not collective."""
        self.wait()
        entries, _ = self._collect(model_modules, optimizers)
        plan = self._plan_for(entries)
        assert self._slab is not None
        peak = self._training_peak(entries)
        warmed = warm_block(plan, self._slab, peak)
        if warmed:   # the peak may count the block from now on: the next save's estimate takes it off
            self._cloned_bytes = warmed
        self._start_writer()

    def _plan_for(self, entries: List[Any]) -> CopyPlan:
        """The slab and the copies for ``entries``, made again only when they are not the entries last planned."""
        if self._plan is None or self._plan[0] is not entries:
            self._plan = None
            self._slab = slab_for(entries, self._slab)
            self._plan = (entries, plan_copies(entries, self._slab))
        return self._plan[1]

    def _start_writer(self) -> WriterProcess:
        """The writing process, started now if it is not yet (its imports overlap training until the first save)."""
        if self._writer is None:
            self._writer = WriterProcess(rank(), world_size())
        return self._writer

    def _training_peak(self, entries: List[Any]) -> Optional[int]:
        """The most GPU memory training allocated, less the last save's GPU block, which the allocator's peak may
        count: the larger of the peak before it and the peak since less its size."""
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
        """Wait for the save in flight (raising its error), end the writing process and let go of the slab."""
        try:
            self.wait()
        finally:
            writer, slab, self._writer, self._slab, self._store = self._writer, self._slab, None, None, None
            self._plan = None
            self._collect.clear()
            if writer is not None:
                writer.close()
            if slab is not None:
                slab.close()

    def _write(self, job: Any, land: Callable[[], None], writer: WriterProcess, slab: HostSlab) -> None:
        try:
            land()
            writer.write(job_of(job), slab)
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
