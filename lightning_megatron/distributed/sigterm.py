"""Whether this process was sent SIGTERM, seen from any thread even while the main thread is blocked.

A launcher ends a run with SIGTERM (torchrun when one worker died, SLURM at preemption or ``scancel``). Python runs
the handler (Lightning installs one) only when the main thread next executes bytecode, which a rank blocked in a
collective's wait never does, so from inside the process the signal goes unnoticed until its SIGKILL 30 s later.
``signal.set_wakeup_fd`` makes the interpreter's C-level handler also write the signal's number to a pipe at once;
the hang detector's thread reads it and, once SIGTERM came, calls a silent peer gone after a few seconds rather than
``LIGHTNING_MEGATRON_DEAD_RANK_S`` (``distributed/hang.py``). A graceful SIGTERM with every rank alive changes
nothing. Installed only from the main thread and only if no other wakeup fd is set (asyncio's, say).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

__all__ = ["SigtermSeen", "SIGTERM_SEEN"]


class SigtermSeen:
    """``install`` once (main thread); ``seen()`` from any thread: whether SIGTERM arrived since."""

    def __init__(self) -> None:
        self._read_fd: Optional[int] = None
        self._seen = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Route the interpreter's signal bytes to our pipe; False (nothing done) off the main thread, without a
        SIGTERM number, or when another wakeup fd is already set."""
        if self._read_fd is not None:
            return True
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read_fd)
            os.close(write_fd)
            return False
        if previous != -1:   # someone else's: put it back
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return False
        self._read_fd = read_fd
        return True

    def seen(self) -> bool:
        with self._lock:
            if self._seen or self._read_fd is None:
                return self._seen
            try:
                data = os.read(self._read_fd, 4096)
            except BlockingIOError:
                return False
            except OSError:
                return False
            self._seen = int(signal.SIGTERM) in data
            return self._seen


SIGTERM_SEEN = SigtermSeen()
