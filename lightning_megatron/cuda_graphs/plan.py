"""Pure planning from a rank's schedule order (seed 003): what runs when, and which static buffers it uses.

The order is ``schedule_order(...)``'s list: ``+k`` forward / ``-k`` backward of local chunk ``k``
(1-based). Within one chunk, forwards meet micro-batches 0, 1, 2, ... and backwards meet them in
the same order (the schedule table per chunk is increasing), so the ``i``-th forward and the
``i``-th backward of a chunk belong to micro-batch ``i``.

Static input buffers: a forward needs its input buffer until its backward has run (the graphs
read the saved input there), so seed 003's rule "a forward takes a free buffer; its backward
frees it" needs only as many buffers as forwards are ever in flight at once -- a number that
grows with the pipeline depth, not with the number of micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class GraphStep:
    """One entry of an order: forward or backward of local ``chunk`` (0-based) on ``microbatch``."""

    is_forward: bool
    chunk: int
    microbatch: int


def order_steps(order: Sequence[int]) -> List[GraphStep]:
    """Number the micro-batches of an order; errors name the first entry that cannot run."""
    if not order:
        raise ValueError("order is empty; pass schedule_order(num_microbatches, pp_size, pp_rank, ...).")
    forwards: Dict[int, int] = {}
    backwards: Dict[int, int] = {}
    steps = []
    for i, entry in enumerate(order):
        if isinstance(entry, bool) or not isinstance(entry, int) or entry == 0:
            raise ValueError(f"order[{i}]={entry!r}: entries are +k (forward) or -k (backward) of local "
                             f"chunk k >= 1, as schedule_order returns.")
        chunk = abs(entry) - 1
        if entry > 0:
            mb = forwards.get(chunk, 0)
            forwards[chunk] = mb + 1
        else:
            mb = backwards.get(chunk, 0)
            if mb >= forwards.get(chunk, 0):
                raise ValueError(f"order[{i}]={entry} is a backward of chunk {abs(entry)} before its forward "
                                 f"(micro-batch {mb} of that chunk has not run forward yet).")
            backwards[chunk] = mb + 1
        steps.append(GraphStep(entry > 0, chunk, mb))
    unfinished = {c + 1: forwards[c] - backwards.get(c, 0) for c in forwards if backwards.get(c, 0)
                  and forwards[c] != backwards[c]}
    if unfinished:
        raise ValueError(f"order leaves forwards without their backward (chunk: missing) {unfinished}; "
                         f"a training order runs one backward per forward.")
    return steps


def num_chunks(order: Sequence[int]) -> int:
    return max(abs(e) for e in order)


def microbatches_per_chunk(order: Sequence[int]) -> int:
    """Micro-batches of a step (every chunk runs each once); errors if the chunks disagree."""
    counts = {abs(e) for e in order if e > 0}
    per = {c: sum(1 for e in order if e == c) for c in counts}
    if len(set(per.values())) != 1:
        raise ValueError(f"order runs chunks a different number of times {per}; every chunk sees every "
                         f"micro-batch once per step.")
    return next(iter(per.values()))


def max_in_flight(order: Sequence[int]) -> int:
    """Most forwards (over all chunks) that have run without their backward at any point."""
    live = peak = 0
    for entry in order:
        live += 1 if entry > 0 else -1
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class BufferPlan:
    """``slot[(chunk, microbatch)]``: the static input buffer each forward uses, per buffer key."""

    slot: Dict[Tuple[int, int], int]
    num_buffers: Dict[Hashable, int]

    @property
    def total_buffers(self) -> int:
        return sum(self.num_buffers.values())


def static_buffer_plan(order: Sequence[int], keys: Optional[Sequence[Hashable]] = None) -> BufferPlan:
    """Assign forward input buffers by seed 003's rule: reuse one whose backward already ran.

    ``keys[c]``: what a buffer of chunk ``c`` must look like (its shapes/dtypes); chunks with equal
    keys share buffers. Default: one key for all chunks. A buffer is freed by the backward of the
    forward that took it, so a buffer is never shared by two micro-batches in flight.
    """
    steps = order_steps(order)
    chunks = num_chunks(order)
    keys = list(keys) if keys is not None else [None] * chunks
    if len(keys) < chunks:
        raise ValueError(f"keys has {len(keys)} entries but the order uses {chunks} chunks; give one key per chunk.")
    free: Dict[Hashable, List[int]] = {}
    count: Dict[Hashable, int] = {}
    slot: Dict[Tuple[int, int], int] = {}
    for step in steps:
        key = keys[step.chunk]
        if step.is_forward:
            pool = free.setdefault(key, [])
            if pool:
                slot[(step.chunk, step.microbatch)] = pool.pop(0)
            else:
                slot[(step.chunk, step.microbatch)] = count.get(key, 0)
                count[key] = count.get(key, 0) + 1
        else:
            free.setdefault(key, []).append(slot[(step.chunk, step.microbatch)])
    return BufferPlan(slot, count)
