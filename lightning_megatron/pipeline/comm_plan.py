"""When each pipeline rank runs each step and what it exchanges with its neighbours; pure.

Running ``schedule_steps`` across ranks needs messages: a forward's output goes to the next
virtual stage, a backward's input gradient to the previous one. Blocking point-to-point only
completes when both sides take part, and NCCL pairs messages by their order, not by a name, so
the sends and receives of neighbours must pair up exactly, step for step. This module fixes the
pairing ahead of time by replaying all ranks' steps in *rounds*: in round ``t`` every rank runs
its next step if that step's input arrived in an earlier round, then every message produced in
round ``t`` is exchanged in round ``t``. A rank's round-``t`` exchange (one batched
isend/irecv) only needs its partners to reach their round-``t`` exchange, which needs nothing of
round ``t`` or later, so every round completes: no deadlock on gloo or NCCL, and nobody waits
for a message that was never sent.

A rank runs at most one step per round, so at most one message travels each way between two
ranks in a round: the pairing is unambiguous even at ``pp_size == 2``, where the previous and
the next stage are the same rank. Rounds are the greedy as-soon-as-possible timeline of the
schedule, i.e. the usual pipeline fill/drain; they are labels for pairing, not barriers: a rank
with nothing to send or receive in a round does not wait for anyone.

Under the zero-bubble schedule (``schedule="zb-h1"``) weight passes are steps too: they wait for
nothing and send nothing, so they take a round of their own and no message.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Optional, Set, Tuple

from .schedules import BACKWARD, FORWARD, ScheduleStep, resolve_group_size, schedule_steps
from .zero_bubble import zero_bubble_h1_schedule
from ..parallel.config import check_pipeline_schedule
from ..parallel.stages import virtual_stage

ChunkMicrobatch = Tuple[int, int]  # (local chunk, micro-batch)


class CommRound(NamedTuple):
    """What one rank does in round ``index``: at most one step, then one batched exchange.

    ``recv_prev`` / ``recv_next`` name the local (chunk, micro-batch) whose forward input
    (activation from the previous stage) / backward input (gradient from the next stage) arrives.
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, which no caller uses
    step: Optional[ScheduleStep]
    send_next: bool
    send_prev: bool
    recv_prev: Optional[ChunkMicrobatch]
    recv_next: Optional[ChunkMicrobatch]

    @property
    def communicates(self) -> bool:
        return (self.send_next or self.send_prev or self.recv_prev is not None
                or self.recv_next is not None)


def comm_plan(num_microbatches: int, pp_size: int, num_model_chunks: int = 1,
              microbatch_group_size_per_vp_stage: Optional[int] = None,
              forward_only: bool = False, schedule: str = "1f1b") -> List[List[CommRound]]:
    """Per pipeline rank, the rounds in which it runs a step or exchanges tensors, in order.

    Every rank's steps appear in exactly ``schedule_steps`` order (``zero_bubble_h1_schedule``'s for
    ``schedule="zb-h1"``, one chunk; forward-only steps are the same for both). Round ``t`` of rank ``r``
    has ``send_next`` iff round ``t`` of rank ``r+1`` has ``recv_prev`` (ranks wrap around, as
    interleaving needs), and ``send_prev`` iff rank ``r-1`` has ``recv_next``.
    """
    g = resolve_group_size(num_microbatches, pp_size, num_model_chunks,
                           microbatch_group_size_per_vp_stage)
    zero_bubble = check_pipeline_schedule(schedule, num_model_chunks) == "zb-h1" and not forward_only
    plan = _plan(num_microbatches, pp_size, num_model_chunks, g, forward_only, zero_bubble)
    return [list(rounds) for rounds in plan]


def _input_of(step: ScheduleStep, stage: int, last_stage: int) -> Optional[Tuple[str, int, int]]:
    """The message a step waits for: its activation (not on stage 0) or its output gradient
    (not on the last stage, whose backward starts from the loss)."""
    if step.is_weight:
        return None
    if step.is_forward:
        return (FORWARD, stage, step.microbatch) if stage > 0 else None
    return (BACKWARD, stage, step.microbatch) if stage < last_stage else None


@lru_cache(maxsize=64)
def _plan(m: int, pp: int, chunks: int, g: int, forward_only: bool,
          zero_bubble: bool = False) -> Tuple[Tuple[CommRound, ...], ...]:
    steps = [zero_bubble_h1_schedule(m, pp, r) if zero_bubble else schedule_steps(m, pp, r, chunks, g, forward_only)
             for r in range(pp)]
    last_stage = pp * chunks - 1
    arrived: Set[Tuple[str, int, int]] = set()
    position = [0] * pp
    rounds: List[List[CommRound]] = [[] for _ in range(pp)]
    index = 0
    step: Optional[ScheduleStep]
    while any(position[r] < len(steps[r]) for r in range(pp)):
        ran: List[Optional[ScheduleStep]] = [None] * pp
        for r in range(pp):
            if position[r] < len(steps[r]):
                step = steps[r][position[r]]
                need = _input_of(step, virtual_stage(pp, r, step.chunk), last_stage)
                if need is None or need in arrived:
                    ran[r] = step
                    position[r] += 1
        if all(step is None for step in ran):
            stuck = {r: steps[r][position[r]] for r in range(pp) if position[r] < len(steps[r])}
            raise RuntimeError(
                f"the pipeline schedule cannot progress at round {index} (M={m}, pp={pp}, "
                f"chunks={chunks}, group={g}): every rank waits for a message no one has sent; "
                f"next steps per rank: {stuck}. This is a bug in schedule_steps.")
        send_next, send_prev = [False] * pp, [False] * pp
        recv_prev: List[Optional[ChunkMicrobatch]] = [None] * pp
        recv_next: List[Optional[ChunkMicrobatch]] = [None] * pp
        for r, step in enumerate(ran):
            if step is None or step.is_weight:
                continue
            stage = virtual_stage(pp, r, step.chunk)
            if step.is_forward and stage < last_stage:
                arrived.add((FORWARD, stage + 1, step.microbatch))
                send_next[r] = True
                recv_prev[(r + 1) % pp] = ((stage + 1) // pp, step.microbatch)
            elif not step.is_forward and stage > 0:
                arrived.add((BACKWARD, stage - 1, step.microbatch))
                send_prev[r] = True
                recv_next[(r - 1) % pp] = ((stage - 1) // pp, step.microbatch)
        for r in range(pp):
            entry = CommRound(index, ran[r], send_next[r], send_prev[r], recv_prev[r], recv_next[r])
            if entry.step is not None or entry.communicates:
                rounds[r].append(entry)
        index += 1
    return tuple(tuple(r) for r in rounds)

