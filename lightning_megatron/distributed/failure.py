"""A rank that fails must not hang its peers: every rank ends within seconds, and says which rank failed.

Lightning's launcher (its child-process observer) and torchrun end every process once one of them exits
with an error. Under NCCL a rank whose step raised does not exit by itself: its peers wait in a collective it
never joins, and its own teardown and the communicators' destructors wait for work that cannot finish, so
nothing ends until the process-group timeout (30 minutes by default).

``FailureWatch`` is started on every rank once the process groups exist. When a rank fails
(``report``: the strategy's ``on_exception``), it

1. writes "rank R failed: <error>" under one key of the rendezvous store (its own client connection, so it
   never interleaves with the process groups' use of the store), which every other rank's watcher thread
   reads within ``poll_s`` and prints;
2. aborts its NCCL communicators (nothing local waits on them any more; gloo ranks get their peers' socket
   errors already and are left alone);
3. arms a last-resort exit: a process still alive ``exit_after_s`` later prints the error and exits with
   status 1, whatever its teardown was waiting for (``LIGHTNING_MEGATRON_EXIT_AFTER_FAILURE_S``, default 8;
   0 turns the watch off, for a script that goes on after catching the error of a multi-GPU fit).

A watcher that saw another rank fail gives its own rank ``exit_after_s`` to end by itself (it may be failing
too, or a launcher may be ending it), then exits with status 1 (a rank blocked in a collective's wait ignores
the SIGTERM of torchrun, which would SIGKILL it only 30 s later). No host sync is
added to the step: the thread only polls the store.

It also runs the hang detector (``distributed/hang.py``, on every backend): a run stuck for
``LIGHTNING_MEGATRON_HANG_TIMEOUT_S`` ends the same way, every rank printing one message that names the rank(s) that
differ and where each rank is.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .hang import HangWatch

__all__ = ["FailureWatch", "FAILURE_KEY"]

FAILURE_KEY = "lightning_megatron/failed_rank"
VERDICT_GRACE_S = 2.0   # after a hang detector's verdict (see FailureWatch._hang_found)


class FailureWatch:
    """See the module docstring; ``start`` after ``init_process_group``, ``stop`` at teardown."""

    def __init__(self, poll_s: float = 0.5, exit_after_s: Optional[float] = None,
                 backends: Tuple[str, ...] = ("nccl",), hang_timeout_s: Optional[float] = None) -> None:
        self.poll_s, self.backends = poll_s, backends
        self.exit_after_s = exit_after_s if exit_after_s is not None else float(
            os.environ.get("LIGHTNING_MEGATRON_EXIT_AFTER_FAILURE_S", 8.0))
        self.hang = HangWatch(hang_timeout_s, on_hang=self._hang_found)   # None: LIGHTNING_MEGATRON_HANG_TIMEOUT_S
        self._store: Optional[dist.Store] = None
        self._stop = threading.Event()
        self._failed_here = threading.Event()
        self._baseline: Optional[bytes] = None

    def wanted(self) -> bool:
        """Multi-process runs on ``backends``: NCCL hangs this way; gloo peers see the failed rank's sockets close
        and raise by themselves."""
        return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                and any(name in str(dist.get_backend()).lower() for name in self.backends))

    def start(self) -> "FailureWatch":
        """Watch this run (again, for a later fit/validate of the same strategy)."""
        self.stop()
        self.hang.start()
        if not self.wanted() or self.exit_after_s <= 0:
            return self
        self._store = _own_store_client()
        if self._store is None:
            return self
        self._stop, self._failed_here = threading.Event(), threading.Event()
        self._baseline = _read(self._store)   # a failure of an earlier run in this process is not this run's
        threading.Thread(target=self._watch, args=(self._store, self._stop), name="lightning_megatron-failure-watch",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        """The run ended: stop watching (a failed rank's own last-resort exit stays armed)."""
        self._stop.set()
        self.hang.stop()

    def report(self, exception: BaseException) -> None:
        """This rank failed: tell the others, abort its NCCL communicators, arm the last-resort exit."""
        if self._failed_here.is_set() or self.hang.fired.is_set():   # after a hang: its own message said it all
            return
        if self._store is None:
            return
        self._failed_here.set()
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        message = f"rank {rank} failed: {type(exception).__name__}: {exception}".strip()
        try:
            self._store.set(FAILURE_KEY, f"{time.time_ns()}|{message}")
        except Exception:   # the store's host may be gone already; the abort and exit below still hold
            pass
        self.hang.stop()   # its record says the run ended here: the peers do not also call this rank gone
        _abort_nccl()
        _exit_later(self.exit_after_s, lambda: traceback.print_exception(exception), threading.Event())

    def _watch(self, store: dist.Store, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            try:
                value = _read(store)
            except Exception:   # the store's host ended: the launcher is ending the run
                return
            if value is None or value == self._baseline or self._failed_here.is_set():
                continue
            message = value.decode(errors="replace").split("|", 1)[-1]
            rank = dist.get_rank() if dist.is_initialized() else "?"
            print(f"lightning_megatron: {message}; rank {rank} stops (no other rank waits for the "
                  f"process-group timeout).", file=sys.stderr, flush=True)
            _exit_later(self.exit_after_s, lambda: None, stop)
            return

    def _hang_found(self, message: str) -> None:
        """The hang detector's verdict reached this rank: say it, abort the NCCL communicators (the blocked
        collective raises), exit with status 1 after at most ``VERDICT_GRACE_S`` whatever this rank is blocked in (a
        gloo collective or a stall in Python cannot be interrupted otherwise; ``exit_after_s`` 0: no forced exit).
        The verdict already waited its detection time, so the grace is short: a dead peer's rank killed at TP2 under
        torchrun took 20.6 s to end with the 8 s grace (2x H200), 10 s of it the detection."""
        rank = dist.get_rank() if dist.is_initialized() else "?"
        print(f"{message}\nrank {rank} stops (exit status 1) rather than wait for the process-group timeout.",
              file=sys.stderr, flush=True)
        _abort_nccl()
        if self.exit_after_s > 0:
            _exit_later(min(self.exit_after_s, VERDICT_GRACE_S), lambda: None, threading.Event())


def _own_store_client() -> Optional[dist.Store]:
    """A client of the rendezvous store's server (Lightning's launcher and torchrun both set these)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10),
                             wait_for_workers=False)
    except Exception:
        return None


def _read(store: dist.Store) -> Optional[bytes]:
    return store.get(FAILURE_KEY) if store.check([FAILURE_KEY]) else None


def _abort_nccl(wait_s: float = 2.0) -> None:
    """Abort every NCCL communicator of this process (collectives and destructors then stop waiting), on a
    thread given ``wait_s``: an abort racing a collective kernel may itself block, and the caller must not."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not (torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower()):
        return

    def abort() -> None:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:
            pass

    thread = threading.Thread(target=abort, name="lightning_megatron-nccl-abort", daemon=True)
    thread.start()
    thread.join(wait_s)


def _exit_later(seconds: float, say: "object", stopped: threading.Event) -> None:
    """Exit the process with status 1 after ``seconds`` unless it ended (or the watch stopped) by then;
    ``os._exit`` neither runs Python's teardown nor waits for the communicators (the driver frees the GPU)."""
    def last_resort() -> None:
        if stopped.wait(seconds):
            return
        try:
            say()   # type: ignore[operator]
            sys.stderr.flush()
        finally:
            os._exit(1)

    threading.Thread(target=last_resort, name="lightning_megatron-last-resort-exit", daemon=True).start()
