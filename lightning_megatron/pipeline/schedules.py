"""Pipeline schedules as pure tables and orders of integers (seed 003); no torch.distributed.

On one pipeline rank with ``C = num_model_chunks`` local chunks and ``M`` micro-batches there
are ``M * C`` *virtual micro-batches*, one per (micro-batch, chunk) pair:

- the **schedule table** lists them in the order their forwards run: micro-batches go in
  groups of ``G = microbatch_group_size_per_vp_stage``; each group passes through chunk 0,
  then chunk 1, ... (``C == 1`` is plain 1F1B: micro-batches 0..M-1);
- backwards walk the same table with the chunk mirrored (``c -> C-1-c``): gradients enter
  at the last virtual stage, so the first backward is of the last chunk;
- the **order** is what the rank runs: ``warmup`` forwards, then ``remaining`` steps of one
  forward followed by one backward (1F1B), then the ``warmup`` backwards still owed.
  ``+k`` / ``-k`` is the forward / backward of local chunk ``k`` (1-based), the convention of
  Transformer Engine's ``make_graphed_callables(_order=...)``.

A third phase, ``weight``, belongs to the zero-bubble schedule (``zero_bubble.py``): there a
backward computes only input gradients and the deferred weight gradients run as a step of their
own. It has no ``+k``/``-k`` entry.

Chunk ``c`` on rank ``r`` is virtual stage ``c * pp_size + r`` (see ``stages.virtual_stage``).
"""

from __future__ import annotations

from typing import List, Literal, NamedTuple, Optional, Tuple

from ..parallel import ParallelConfigError
from ..parallel._checks import check_int, check_rank, listing, nearest

FORWARD: Literal["forward"] = "forward"
BACKWARD: Literal["backward"] = "backward"
WEIGHT: Literal["weight"] = "weight"   # zero-bubble: the weight gradients a backward deferred


class MicrobatchCounts(NamedTuple):
    """Virtual micro-batch counts of one rank, in Megatron-Core's tuple order."""

    total_num_microbatches: int
    are_all_microbatches_in_warmup: bool
    num_warmup_microbatches: int
    num_microbatches_remaining: int


class ScheduleStep(NamedTuple):
    """One entry of a rank's order: run ``phase`` of local ``chunk`` (0-based) on ``microbatch``."""

    phase: Literal["forward", "backward", "weight"]
    chunk: int
    microbatch: int

    @property
    def is_forward(self) -> bool:
        return self.phase == FORWARD

    @property
    def is_weight(self) -> bool:
        """A zero-bubble weight-gradient pass: no input, nothing sent."""
        return self.phase == WEIGHT

    @property
    def order_entry(self) -> int:
        """``+(chunk+1)`` for a forward, ``-(chunk+1)`` for a backward (a weight pass has none)."""
        if self.is_weight:
            raise ValueError(f"{self} is a weight-gradient pass: the +k/-k order has no entry for it "
                             "(only 1F1B and interleaved orders are written that way).")
        return self.chunk + 1 if self.is_forward else -(self.chunk + 1)


def resolve_group_size(num_microbatches: int, pp_size: int, num_model_chunks: int = 1,
                       microbatch_group_size_per_vp_stage: Optional[int] = None) -> int:
    """Check a schedule's sizes and return the group size (default ``pp_size``, as Megatron-Core).

    Interleaving (``num_model_chunks > 1``) needs ``pp_size <= G <= num_microbatches``: a group
    shorter than the pipeline cannot keep every rank busy while its first micro-batch travels
    through the ``pp_size`` stages of a chunk, and a group cannot hold more micro-batches than
    exist. A short final group (``0 < M % G < pp_size``) is refused for the same reason: its
    micro-batches enter the next chunk before they have crossed the pipeline, so ranks wait
    (Megatron-Core's "dependency bubbles"; with a fixed per-rank order, even a deadlock).
    """
    m = check_int("num_microbatches", num_microbatches)
    pp = check_int("pp_size", pp_size)
    c = check_int("num_model_chunks", num_model_chunks)
    g = pp if microbatch_group_size_per_vp_stage is None else check_int(
        "microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage)
    if c == 1:
        return g

    def m_ok(m_: int, g_: int = g) -> bool:
        return m_ >= g_ and (m_ % g_ == 0 or m_ % g_ >= pp)

    valid_g = [g_ for g_ in range(pp, m + 1) if m_ok(m, g_)]
    if m < pp:
        raise ParallelConfigError(
            f"num_microbatches={m} is smaller than pp_size={pp}: the interleaved schedule "
            f"(num_model_chunks={c}) needs at least pp_size micro-batches per step so every stage "
            f"has work while a micro-batch crosses the pipeline; use num_microbatches >= {pp} "
            f"(e.g. {listing(nearest(lambda v: v % pp == 0, m, pp, m + 2 * pp))}), "
            f"or num_model_chunks=1."
        )
    if not pp <= g <= m:
        raise ParallelConfigError(
            f"microbatch_group_size_per_vp_stage={g} must lie in [pp_size={pp}, "
            f"num_microbatches={m}] when num_model_chunks={c} > 1 (a group shorter than the "
            f"pipeline leaves stages idle; a group cannot exceed the micro-batches there are); "
            f"values that work for num_microbatches={m}: {listing(valid_g)}."
        )
    if not m_ok(m):
        near_m = nearest(m_ok, m, g, m + 2 * g)
        raise ParallelConfigError(
            f"num_microbatches={m} leaves a final group of {m % g} micro-batches "
            f"(num_microbatches % microbatch_group_size_per_vp_stage = {m} % {g}), fewer than "
            f"pp_size={pp}. Megatron-Core requires that remainder to be 0 or >= pp_size: a short "
            f"final group reaches the next model chunk before its micro-batches have crossed all "
            f"{pp} stages, so ranks stall ('dependency bubbles'; a fixed per-rank order can even "
            f"deadlock). Valid num_microbatches near {m} for group size {g}: {listing(near_m)}; "
            f"valid microbatch_group_size_per_vp_stage for num_microbatches={m}: "
            f"{listing(valid_g)}."
        )
    return g


def get_pp_rank_microbatches(num_microbatches: int, num_model_chunks: int,
                             microbatch_group_size_per_vp_stage: Optional[int], pp_size: int,
                             pp_rank: int, forward_only: bool = False) -> MicrobatchCounts:
    """Total, all-in-warm-up flag, warm-up and remaining virtual micro-batches of ``pp_rank``.

    Warm-up is how many forwards a rank runs before its first backward:
    1F1B: ``pp_size - pp_rank - 1``, one per later stage the first micro-batch must cross.
    Interleaved: ``(pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * G``: every rank first
    pushes one group through chunks 0..C-2, and earlier ranks run two further ahead per later
    stage. ``pp_size == 1`` without chunks gives 0, i.e. F,B,F,B (no pipelining).
    Capped at the total; forward-only is all warm-up.
    """
    g = resolve_group_size(num_microbatches, pp_size, num_model_chunks,
                           microbatch_group_size_per_vp_stage)
    check_rank("pp_rank", pp_rank, "pp_size", pp_size)
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif num_model_chunks == 1:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = (pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * g
    warmup = min(warmup, total)
    return MicrobatchCounts(total, warmup == total, warmup, total - warmup)


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> List[Tuple[int, int]]:
    """``(microbatch_id, model_chunk_id)`` in the order forwards run; the same on every rank.

    Groups of ``G`` consecutive micro-batches, each group through chunk 0, 1, ..., C-1; the last
    group holds what is left (Megatron-Core's tunable table: M5 G3 C2 gives micro-batches
    0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1).
    """
    m = check_int("num_microbatches", num_microbatches)
    c = check_int("num_model_chunks", num_model_chunks)
    g = check_int("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage)
    return [(mb, chunk)
            for start in range(0, m, g)
            for chunk in range(c)
            for mb in range(start, min(start + g, m))]


def convert_schedule_table_to_steps(num_warmup_microbatches: int, num_model_chunks: int,
                                    schedule_table: List[Tuple[int, int]]) -> List[ScheduleStep]:
    """Warm-up forwards, then 1F1B pairs (forward ``warmup + i``, backward ``i``), then the rest.

    The ``i``-th backward is the table's ``i``-th entry with its chunk mirrored. Only the
    arithmetic: whether the warm-up keeps the pipeline fed is ``schedule_steps``' business.
    """
    warmup = check_int("num_warmup_microbatches", num_warmup_microbatches, minimum=0)
    c = check_int("num_model_chunks", num_model_chunks)
    forwards = [ScheduleStep(FORWARD, chunk, mb) for mb, chunk in schedule_table]
    backwards = [ScheduleStep(BACKWARD, c - 1 - chunk, mb) for mb, chunk in schedule_table]
    remaining = max(len(schedule_table) - warmup, 0)
    steps = forwards[:warmup]
    for fwd, bwd in zip(forwards[warmup:], backwards[:remaining]):
        steps += [fwd, bwd]
    return steps + backwards[remaining:]


def convert_schedule_table_to_order(num_warmup_microbatches: int, num_model_chunks: int,
                                    schedule_table: List[Tuple[int, int]]) -> List[int]:
    """``convert_schedule_table_to_steps`` as ``+k``/``-k`` ints (seed 003's name and arguments)."""
    return [step.order_entry for step in convert_schedule_table_to_steps(
        num_warmup_microbatches, num_model_chunks, schedule_table)]


def schedule_steps(num_microbatches: int, pp_size: int, pp_rank: int, num_model_chunks: int = 1,
                   microbatch_group_size_per_vp_stage: Optional[int] = None,
                   forward_only: bool = False) -> List[ScheduleStep]:
    """The steps ``pp_rank`` runs, in order: what an executor or a CUDA-graph capture iterates.

    Run as given, with a forward receiving its input from the previous virtual stage (unless
    first) and a backward its output gradient from the next (unless last), and sends that do
    not block, every rank's steps complete. Forward-only is the table's forwards.
    """
    g = resolve_group_size(num_microbatches, pp_size, num_model_chunks,
                           microbatch_group_size_per_vp_stage)
    counts = get_pp_rank_microbatches(num_microbatches, num_model_chunks, g, pp_size, pp_rank,
                                      forward_only)
    table = get_schedule_table(num_microbatches, num_model_chunks, g)
    if forward_only:
        return [ScheduleStep(FORWARD, chunk, mb) for mb, chunk in table]
    return convert_schedule_table_to_steps(counts.num_warmup_microbatches, num_model_chunks, table)


def schedule_order(num_microbatches: int, pp_size: int, pp_rank: int, num_model_chunks: int = 1,
                   microbatch_group_size_per_vp_stage: Optional[int] = None,
                   forward_only: bool = False) -> List[int]:
    """The rank's order as ints: ``+k`` forward / ``-k`` backward of local chunk ``k`` (1-based).

    Seed 003 (M=8, pp=4, C=2, rank 0; warm-up 10)::

        [1,1,1,1, 2,2,2,2, 1,1,                              # warm-up
         1,-2, 1,-2, 2,-2, 2,-2, 2,-1, 2,-1,                  # 1F1B
         -1,-1, -2,-2,-2,-2, -1,-1,-1,-1]                     # cool-down
    """
    return [step.order_entry for step in schedule_steps(
        num_microbatches, pp_size, pp_rank, num_model_chunks, microbatch_group_size_per_vp_stage,
        forward_only)]
