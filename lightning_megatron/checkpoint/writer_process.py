"""The process that writes background saves: the training process's threads never wait for its Python.

Written by a thread of the training process, a save's Python (DCP's planning, pickling every item, checksums)
competed with training for the GIL, and every training thread gives the GIL up at each operator: GPT-1.3B on an
H200 took 1.4-4x its step time for the steps a write overlapped. This process runs that Python instead. It maps the
training process's host slab (``host_slab.py``, its descriptor and layout, placements included, sent once over a
Unix socket), receives each save as a path and pickled objects, writes the slab's entries with ``SaveJob.write`` and
answers ``None`` or the error.
Across ranks the writers form a gloo group of their own (rank 0's training process serves its store).

The process is started with ``python -m`` (not multiprocessing's spawn, which re-runs an unguarded training
script), and ends when told, or at once when its training process is gone (a second pipe reads end-of-file): a save
cut off that way never commits, so its folder stays ``.incomplete``.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from .collective import distributed
from .host_slab import HostSlab, Layout
from .sharded import SaveJob

#: a function run first in every writing process started from now on (tests plant faults in the writer with it);
#: must be importable by name
CHILD_SETUP: Optional[Callable[[], None]] = None
#: how long the writers' collectives wait for each other (a save that takes longer fails)
GROUP_TIMEOUT = timedelta(minutes=30)

Job = Tuple[str, str, Dict[str, Any], bool]   # path, staging, pickled objects, checksums


class WriterProcess:
    """One writing process per training process, started ahead of the first save (its imports take seconds).
    ``connect`` gives it the store of the writers' group (``rendezvous``, collective over the training's ranks);
    ``write`` blocks (without the GIL) until the save is written or failed."""

    def __init__(self, rank: int, world_size: int) -> None:
        parent, child = socket.socketpair()
        alive_read, self._alive = os.pipe()   # the child reads end-of-file once this process is gone
        command = [sys.executable, "-m", "lightning_megatron.checkpoint.writer_process", str(child.fileno()),
                   str(alive_read)]
        self.process = subprocess.Popen(command, pass_fds=(child.fileno(), alive_read), stdin=subprocess.DEVNULL)
        child.close()
        os.close(alive_read)
        self._socket = parent
        self._conn = Connection(os.dup(parent.fileno()))
        self._conn.send(list(sys.path))   # first: the rest may name functions only found on it
        self._conn.send((CHILD_SETUP, rank, world_size))
        self._layout: Optional[Layout] = None   # the slab's layout the child maps now
        self.connected = False

    def connect(self, store_address: Optional[Tuple[str, int]]) -> None:
        """Send the address of the writers' store (``None``: a single process, no group)."""
        self._conn.send(store_address)
        self.connected = True

    def write(self, job: Job, slab: HostSlab) -> None:
        """Have the child write ``job`` from ``slab``; raise its error."""
        try:
            if self._layout is not slab.layout:
                self._conn.send(("slab", slab.layout))
                send_handle(self._conn, slab.fd, self.process.pid)
                self._layout = slab.layout
            self._conn.send(("write", job))
            reply = self._conn.recv()
        except (EOFError, OSError) as err:
            raise RuntimeError(f"the checkpoint writing process ended (exit code {self.process.poll()}) "
                               f"before the save was written") from err
        if reply is not None:
            raise pickle.loads(reply)

    def close(self, timeout: float = 60.0) -> None:
        """End the child (it reads end-of-file; it may be waiting for any message) and wait for it (killed after
        ``timeout`` s). One that never wrote is killed at once: it has nothing to finish, maybe its imports."""
        self._conn.close()
        self._socket.close()
        if not self.connected:
            self.process.kill()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._alive)


def rendezvous() -> Tuple[Optional[Tuple[str, int]], Any]:
    """Rank 0 serves a store for the writers' group; every rank learns its address (collective).
    Returns the address (``None`` in a single process) and the store to keep alive (rank 0's, else ``None``)."""
    if not distributed():
        return None, None
    store, address = None, None
    if dist.get_rank() == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")   # where the other ranks reach rank 0
        store = dist.TCPStore(host, 0, dist.get_world_size(), is_master=True, wait_for_workers=False,
                              timeout=GROUP_TIMEOUT)
        address = (host, store.port)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, address)
    return gathered[0], store


def job_of(save: SaveJob) -> Job:
    """What the child needs of ``save`` besides the slab (whose layout says the entries: a save's entries are
    exactly those the slab places)."""
    return save.path, save.staging, save.blobs, save.checksums


def _serve(conn: Connection, alive: int) -> None:
    """Write every save sent until the training process closes the connection."""
    try:
        sys.path[:] = conn.recv()
        setup, rank, world_size = conn.recv()
        threading.Thread(target=_end_with_parent, args=(alive,), daemon=True).start()
        if setup is not None:
            setup()
        address = conn.recv()
        if address is not None:
            store = dist.TCPStore(address[0], address[1], world_size, is_master=False, timeout=GROUP_TIMEOUT)
            dist.init_process_group("gloo", store=dist.PrefixStore("lightning-megatron-writers", store), rank=rank,
                                    world_size=world_size, timeout=GROUP_TIMEOUT)
        slab: Optional[HostSlab] = None
        while True:
            message = conn.recv()
            if message[0] == "slab":
                if slab is not None:
                    slab.close()
                slab = HostSlab(message[1], fd=recv_handle(conn))
                continue
            path, staging, blobs, checksums = message[1]
            try:
                assert slab is not None, "no slab was sent"
                SaveJob(path, staging, slab.layout.entries(slab), blobs, checksums).write()
                conn.send(None)
            except BaseException as err:  # noqa: BLE001 - the training process raises it
                conn.send(_picklable(err))
    except EOFError:
        pass   # closed: the end
    finally:
        if distributed():
            dist.destroy_process_group()


def _picklable(err: BaseException) -> bytes:
    try:
        return pickle.dumps(err)
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its type and text
        return pickle.dumps(RuntimeError(f"{type(err).__name__}: {err}"))


def _end_with_parent(alive: int) -> None:
    """Return from ``read`` only when the training process is gone (end-of-file): end this one at once."""
    while os.read(alive, 1):
        pass
    os._exit(1)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
