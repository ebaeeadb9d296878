"""The hang detector: a stuck run names the rank(s) that differ and where every rank is, long before the
process-group timeout (30 minutes by default) ends it with no such word.

Each rank's watcher thread publishes, every ``poll_s``, its position (``parallel/heartbeat.py``: step,
stage, micro-batch, schedule action or collective), its main thread's Python location, and whether that thread
waits on its peers. Two judges (ranks 0 and world-1) read every rank's record; when no rank whose run goes on has
moved (heartbeat or Python location) for ``timeout_s`` (``LIGHTNING_MEGATRON_HANG_TIMEOUT_S``, default 300; 0
turns it off), the first judge writes one verdict (``hang_report.hang_message``) under one store key, and every
rank's watcher hands that same message to ``on_hang`` (``FailureWatch``: print it, abort the NCCL communicators so
a blocked collective raises, and exit with status 1 after its grace: a rank blocked in a gloo collective, or
stalled in Python, cannot be interrupted otherwise). Nothing is added to the step: no host sync, no tensor;
the threads only poll the rendezvous store (own client connection), O(world) reads per judge per poll.

A rank whose watcher stops publishing for ``dead_after_s`` (``LIGHTNING_MEGATRON_DEAD_RANK_S``, default 10; 0 turns
it off) is gone (SIGKILL, the out-of-memory killer, a frozen host): its own failure report never came, and under
torchrun its peers, blocked in a collective, ignore the SIGTERM that would end them (Lightning's handler waits for
the main thread), so they would wait 30 s for the SIGKILL, or for the process-group timeout. The judges say so at
once, with the same verdict path. The publisher is a thread of its own, so a busy or blocked main thread does not
look dead. Once this process has been sent SIGTERM (``distributed/sigterm.py``: torchrun sends it when a worker
died) a peer silent for ``AFTER_SIGTERM_DEAD_S`` is gone: the launcher is ending the run already.

Not judged: the setup before every rank has started its first step (checkpoint loading, model construction), and
nothing after a rank's watch stopped. Legitimately slow work that moves neither heartbeat nor Python location for
longer than the timeout (one very long checkpoint save, a first-step compilation in one C call) needs a larger
``LIGHTNING_MEGATRON_HANG_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from types import FrameType
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from ..parallel.heartbeat import HEARTBEAT, Heartbeat, describe
from .hang_report import dead_rank_message, hang_message, is_stuck
from .sigterm import SIGTERM_SEEN

__all__ = ["HangWatch", "HANG_TIMEOUT_ENV", "DEFAULT_HANG_TIMEOUT_S", "DEAD_RANK_ENV", "HEARTBEAT_PREFIX"]

HANG_TIMEOUT_ENV = "LIGHTNING_MEGATRON_HANG_TIMEOUT_S"
DEFAULT_HANG_TIMEOUT_S = 300.0
DEAD_RANK_ENV = "LIGHTNING_MEGATRON_DEAD_RANK_S"
DEFAULT_DEAD_RANK_S = 10.0
AFTER_SIGTERM_DEAD_S = 3.0   # a peer this long silent is gone once the launcher sent this process SIGTERM
HEARTBEAT_PREFIX = "lightning_megatron/heartbeat"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class HangWatch:
    """See the module docstring; ``start`` once the process groups exist, ``stop`` at teardown."""

    def __init__(self, timeout_s: Optional[float] = None, on_hang: Callable[[str], None] = _say,
                 poll_s: Optional[float] = None, heartbeat: Heartbeat = HEARTBEAT,
                 dead_after_s: Optional[float] = None, sigterm_seen: Callable[[], bool] = SIGTERM_SEEN.seen) -> None:
        self.timeout_s = float(os.environ.get(HANG_TIMEOUT_ENV, DEFAULT_HANG_TIMEOUT_S)) if timeout_s is None \
            else float(timeout_s)
        self.dead_after_s = float(os.environ.get(DEAD_RANK_ENV, DEFAULT_DEAD_RANK_S)) if dead_after_s is None \
            else float(dead_after_s)
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(self.timeout_s / 4, 0.05))
        self.on_hang, self.heartbeat, self.sigterm_seen = on_hang, heartbeat, sigterm_seen
        self.fired = threading.Event()   # a verdict reached this rank
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def wanted(self) -> bool:
        return self.timeout_s > 0 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def start(self) -> "HangWatch":
        """Watch this run (again, for a later fit/validate of the same strategy)."""
        self.stop()
        if not self.wanted():
            return self
        store = _own_store_client()
        if store is None:
            return self
        SIGTERM_SEEN.install()   # here, on the main thread
        rank, world = dist.get_rank(), dist.get_world_size()
        try:   # every rank adds 1 per run: the runs of one process and its peers number alike
            run = (int(store.add(f"{HEARTBEAT_PREFIX}/starts", 1)) - 1) // world
        except Exception:
            return self
        self.heartbeat.reset()
        self._stop, self.fired = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lightning_megatron-hang-watch", daemon=True,
                                        args=(store, f"{HEARTBEAT_PREFIX}/{run}", rank, world, threading.get_ident(),
                                              self._stop))
        self._thread.start()
        return self

    def stop(self) -> None:
        """The run ended here: this rank's record says so (peers then name it if they are stuck)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.poll_s + 1.0)

    def _record(self, main: int, published: int, finished: bool = False) -> Dict[str, Any]:
        beat = self.heartbeat
        python, in_collective = _python_location(main)
        return {"published": published, "ticks": beat.ticks, "seq": beat.seq, "finished": finished, "python": python,
                "waiting": bool(beat.waiting or in_collective),
                "where": describe(beat.kind, beat.index, beat.inside, beat.action, beat.microbatch, beat.chunk,
                                  beat.stage)}

    def _watch(self, store: dist.Store, prefix: str, rank: int, world: int, main: int,
               stop: threading.Event) -> None:
        keys = [f"{prefix}/rank{r}" for r in range(world)]
        verdict = f"{prefix}/verdict"
        judge = rank in (0, world - 1)
        seen: Dict[int, Tuple[Any, ...]] = {}
        moved: Dict[int, float] = {}
        heard: Dict[int, Tuple[int, float]] = {}   # rank -> (its last publication, when it changed)
        published = 0
        try:
            while True:
                published += 1
                store.set(keys[rank], json.dumps(self._record(main, published)))
                if stop.wait(self.poll_s):
                    store.set(keys[rank], json.dumps(self._record(main, published + 1, finished=True)))
                    return
                if store.check([verdict]):
                    self._fire(store.get(verdict))
                    return
                if not judge or not store.check(keys):
                    continue
                records = {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))}
                now = time.monotonic()
                for r, rec in records.items():
                    if heard.get(r, (None,))[0] != rec["published"]:
                        heard[r] = (rec["published"], now)
                terminated = self.dead_after_s > 0 and self.sigterm_seen()
                dead_after = min(self.dead_after_s, AFTER_SIGTERM_DEAD_S) if terminated else self.dead_after_s
                silent = sorted(r for r, rec in records.items() if not rec["finished"] and r != rank
                                and now - heard[r][1] >= dead_after > 0)
                if silent:
                    message = dead_rank_message(silent, records, dead_after, after_sigterm=terminated)
                    self._fire(store.compare_set(verdict, "", message))
                    return
                for r, rec in records.items():
                    signature = (rec["ticks"], rec["python"], rec["finished"])
                    if seen.get(r) != signature:
                        seen[r], moved[r] = signature, now
                quiet = {r: now - moved[r] for r in records}
                if is_stuck(records, quiet, self.timeout_s):
                    setting = f"{HANG_TIMEOUT_ENV}={self.timeout_s:g}"
                    message = hang_message(records, min(quiet[r] for r in records if not records[r]["finished"]),
                                           setting)
                    self._fire(store.compare_set(verdict, "", message))   # the first judge's verdict, for all
                    return
        except Exception:   # the store's host ended: the run is ending anyway
            return

    def _fire(self, message: Any) -> None:
        self.fired.set()
        self.on_hang(message.decode(errors="replace") if isinstance(message, bytes) else str(message))


def _own_store_client() -> Optional[dist.Store]:
    """A client of its own to the default group's TCPStore (so it never interleaves with the process groups' use of
    the store); the default group's store itself when that is not a TCPStore (a FileStore: test harnesses)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return store
    try:
        return dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=10),
                             wait_for_workers=False)
    except Exception:
        return None


_STDLIB = os.path.dirname(os.path.realpath(os.__file__)) + os.sep   # the standard library
_LIBRARIES = tuple(f"{os.sep}{name}{os.sep}" for name in ("torch", "lightning", "lightning_fabric",
                                                           "pytorch_lightning", "torchmetrics"))
_COLLECTIVES = f"{os.sep}torch{os.sep}distributed{os.sep}"


def _is_library(path: str) -> bool:
    if any(part in path for part in _LIBRARIES):
        return True
    return path.startswith(_STDLIB) and "-packages" not in path


def _short(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    return f"{os.sep.join(path.split(os.sep)[-2:])}:{frame.f_lineno} in {frame.f_code.co_name}"


def _python_location(thread_id: int) -> Tuple[str, bool]:
    """Where the thread is ("file:line in function", and the innermost frame outside torch, Lightning and the
    standard library when that is another), and whether it is inside torch.distributed (a blocking collective)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "unknown (the thread ended)", False
    own = frame
    while own is not None and _is_library(own.f_code.co_filename):
        own = own.f_back   # type: ignore[assignment]
    text = _short(frame) if own is None or own is frame else f"{_short(frame)} (from {_short(own)})"
    return text, _COLLECTIVES in frame.f_code.co_filename
