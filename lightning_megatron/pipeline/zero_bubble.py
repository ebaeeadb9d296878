"""ZB-H1, the zero-bubble schedule for 1F1B (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"); pure.

A backward is split in two: ``B`` computes the input gradients only (sent upstream at once, so the
previous stage starts its own ``B`` sooner) and ``W`` the weight gradients, which nothing downstream
waits for. Stage ``r`` of ``p`` runs 1F1B's warm-up (``p - 1 - r`` forwards), then ``F, B`` pairs whose
``W`` follows the ``B`` with a lag of ``r`` micro-batches, then the cool-down's ``B, W`` pairs, then the
``r`` weight passes still owed: they fill the tail, where 1F1B waits for the gradients of later stages.

Memory: at most ``min(p, m)`` micro-batches per stage are between their ``F`` and their ``W`` (what
stage 0 of 1F1B holds; a later stage holds more than under 1F1B, never more than stage 0), and no more
are between ``F`` and ``B`` than under 1F1B (``p - r``).

Time, simulated with unit costs ``F = B = W = 1`` (1F1B's backward ``B + W = 2``): for ``m >= p`` a step
takes ``3m + p - 1`` units instead of 1F1B's ``3(m + p - 1)``: the bubble shrinks to a third. E.g. p=4:
m=8 bubble 11.1% (1F1B 27.3%), m=16 5.9% (15.8%); p=2, m=8: 4.0% (11.1%). See ``simulated_step_time``.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .schedules import BACKWARD, FORWARD, WEIGHT, ScheduleStep, schedule_steps
from ..parallel._checks import check_int, check_rank

UNIT_COSTS: Dict[str, float] = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}


def zero_bubble_h1_schedule(num_microbatches: int, pp_size: int, pp_rank: int) -> List[ScheduleStep]:
    """The steps ``pp_rank`` runs under ZB-H1, in order (one model chunk): forwards, input-gradient
    backwards and weight passes (``phase == "weight"``) of every micro-batch, each exactly once."""
    m = check_int("num_microbatches", num_microbatches)
    p = check_int("pp_size", pp_size)
    r = check_rank("pp_rank", pp_rank, "pp_size", p)
    warmup = min(p - 1 - r, m)
    lag = min(r, m - warmup)   # B's whose W waits: the tail's weight passes
    steps = [ScheduleStep(FORWARD, 0, mb) for mb in range(warmup)]
    next_w = 0

    def weight() -> None:
        nonlocal next_w
        steps.append(ScheduleStep(WEIGHT, 0, next_w))
        next_w += 1

    for i in range(m - warmup):   # steady state: F, B, and a W once the lag is built up
        steps += [ScheduleStep(FORWARD, 0, warmup + i), ScheduleStep(BACKWARD, 0, i)]
        if i >= lag:
            weight()
    for i in range(m - warmup, m):   # cool-down: the B's still owed, each followed by a W
        steps.append(ScheduleStep(BACKWARD, 0, i))
        weight()
    while next_w < m:   # the lagging W's fill the tail
        weight()
    return steps


def simulated_step_time(steps_per_rank: Sequence[Sequence[ScheduleStep]],
                        costs: Dict[str, float] = UNIT_COSTS) -> float:
    """When the last rank finishes, if each rank runs its steps in order as soon as their inputs are there
    (one chunk per rank; messages take no time). ``costs``: duration per phase."""
    p = len(steps_per_rank)
    done: Dict[Tuple[str, int, int], float] = {}   # (phase, stage, micro-batch) -> finish time
    clock = [0.0] * p
    position = [0] * p
    while any(position[r] < len(steps_per_rank[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(steps_per_rank[r]):
                step = steps_per_rank[r][position[r]]
                need = (None if step.is_weight or (step.is_forward and r == 0) or (not step.is_forward and r == p - 1)
                        else (step.phase, r - 1 if step.is_forward else r + 1, step.microbatch))
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need is not None else 0.0)
                clock[r] = done[(step.phase, r, step.microbatch)] = start + costs[step.phase]
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the simulated pipeline deadlocks: every rank waits for a step no one runs.")
    return max(clock)


def bubble_fraction(num_microbatches: int, pp_size: int, zero_bubble: bool) -> float:
    """Idle share of a step with unit costs: ZB-H1 (``F = B = W = 1``) or 1F1B (backward ``= 2``)."""
    if zero_bubble:
        steps = [zero_bubble_h1_schedule(num_microbatches, pp_size, r) for r in range(pp_size)]
        time = simulated_step_time(steps)
    else:
        steps = [schedule_steps(num_microbatches, pp_size, r) for r in range(pp_size)]
        time = simulated_step_time(steps, {FORWARD: 1.0, BACKWARD: 2.0, WEIGHT: 0.0})
    return 1.0 - 3.0 * num_microbatches / time
