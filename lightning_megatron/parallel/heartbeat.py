"""Where this process is in the run: the host-side record the hang detector reads (``distributed/hang.py``).

The step engine, the pipeline executor and the step protocol set it at each step, schedule action (stage,
chunk, micro-batch, forward/backward/send/receive) and each blocking collective they issue from Python. It is
one process-wide object, ``HEARTBEAT``, on purpose: the watcher thread must read it while the main thread is
blocked, and threading a diagnostic through every schedule and collective would cost more than it tells.

An update is a few plain attribute stores (about 100-200 ns: no lock, no tensor, no device sync); it never
runs inside compiled layers or captured graphs. The watcher thread may read a half-made update, which only
blurs one description that it reads again a second later; ``ticks`` tells it that the process moved.
"""

from __future__ import annotations

from typing import Dict, Optional

__all__ = ["HEARTBEAT", "Heartbeat", "describe"]


class Heartbeat:
    """This process's position. ``seq`` counts step starts and ends (equal on every rank at the same point of
    an SPMD run: each rank runs the same batches), ``ticks`` every update."""

    __slots__ = ("ticks", "seq", "kind", "index", "inside", "action", "microbatch", "chunk", "stage", "waiting",
                 "_counts")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new run is watched: batches count from 0 again."""
        self.ticks = self.seq = 0
        self.kind: str = ""
        self.index = -1
        self.inside = False
        self.action: Optional[str] = "setting up"
        self.microbatch: Optional[int] = None
        self.chunk: Optional[int] = None
        self.stage: Optional[int] = None
        self.waiting = False
        self._counts: Dict[str, int] = {}

    def begin(self, kind: str) -> None:
        """A step of ``kind`` ("training batch", "evaluation batch") starts; its index counts from 0 per run."""
        index = self._counts.get(kind, -1) + 1
        self._counts[kind] = index
        self.kind, self.index, self.inside = kind, index, True
        self.action, self.microbatch, self.chunk, self.stage, self.waiting = "starting", None, None, None, False
        self.seq += 1
        self.ticks += 1

    def end(self) -> None:
        """The step's own work is done: the driver's loop runs (data loading, callbacks, logging, checkpoints)."""
        self.inside = False
        self.action, self.microbatch, self.chunk, self.stage, self.waiting = None, None, None, None, False
        self.seq += 1
        self.ticks += 1

    def at(self, action: Optional[str], microbatch: Optional[int] = None, chunk: Optional[int] = None,
           stage: Optional[int] = None, waiting: bool = False) -> None:
        """Now doing ``action`` (``None``: back in the driver's loop); ``waiting``: a collective or exchange that
        needs the peers."""
        self.action, self.microbatch, self.chunk, self.stage, self.waiting = action, microbatch, chunk, stage, waiting
        self.ticks += 1


HEARTBEAT = Heartbeat()


def describe(kind: str, index: int, inside: bool, action: Optional[str], microbatch: Optional[int] = None,
             chunk: Optional[int] = None, stage: Optional[int] = None) -> str:
    """A position in words: "training batch 3, stage 1, micro-batch 2, backward" or "after training batch 2
    (between steps: ...)"."""
    if not kind:
        return action or "before the first step"
    if not inside:
        head = f"after {kind} {index}"
        return f"{head}, {action}" if action else f"{head} (between steps: data loading, callbacks, logging, " \
                                                  f"checkpointing)"
    parts = [f"{kind} {index}"]
    if stage is not None:
        parts.append(f"stage {stage}")
    if chunk is not None:
        parts.append(f"chunk {chunk}")
    if microbatch is not None:
        parts.append(f"micro-batch {microbatch}")
    if action:
        parts.append(action)
    return ", ".join(parts)
