"""Pipeline schedules: seed 003's worked example, Megatron-Core's table, properties over an
exhaustive grid, a simulated pipeline of all ranks (no deadlock, ideal length), and errors."""

import pytest

from lightning_megatron.parallel import ParallelConfigError
from lightning_megatron.pipeline.schedules import (
    BACKWARD, FORWARD, ScheduleStep, convert_schedule_table_to_order,
    convert_schedule_table_to_steps, get_pp_rank_microbatches, get_schedule_table,
    resolve_group_size, schedule_order, schedule_steps,
)
from lightning_megatron.parallel.stages import virtual_stage

# --- seed 003: 8 micro-batches, PP 4, VPP 2 (group size defaults to PP = 4) ----------------------

SEED003_TABLE = [
    (0, 0), (1, 0), (2, 0), (3, 0),  # chunk 0, mb 0-3
    (0, 1), (1, 1), (2, 1), (3, 1),  # chunk 1, mb 0-3
    (4, 0), (5, 0), (6, 0), (7, 0),  # chunk 0, mb 4-7
    (4, 1), (5, 1), (6, 1), (7, 1),  # chunk 1, mb 4-7
]
# The seed's Step 3 derivation for rank 0 (its "Device 1"): warm-up forward_order[:10], six 1F1B
# pairs, cool-down backward_order[-10:]. (The seed's earlier, annotated listing of the same order
# has a slip after the warm-up: "1,-1, 1,-1, 2,-2, 2,-2, 2,-1, 2,-1" and "-2,-2,-1,-1,-2,-2,-1,-1,
# -2,-2" contradict its own legend, -k = backward of chunk k, and its own Step 3.)
SEED003_RANK0_ORDER = [
    1, 1, 1, 1, 2, 2, 2, 2, 1, 1,
    1, -2, 1, -2, 2, -2, 2, -2, 2, -1, 2, -1,
    -1, -1, -2, -2, -2, -2, -1, -1, -1, -1,
]


def test_seed003_schedule_table():
    assert get_schedule_table(8, 2, 4) == SEED003_TABLE


def test_seed003_warmup_formula():
    # (PP - rank - 1) * 2 + (VPP - 1) * microbatch_group_size_per_vp_stage
    assert get_pp_rank_microbatches(8, 2, 4, 4, 0) == (16, False, 10, 6)
    assert [get_pp_rank_microbatches(8, 2, None, 4, r).num_warmup_microbatches
            for r in range(4)] == [10, 8, 6, 4]


def test_seed003_rank0_order():
    assert schedule_order(8, 4, 0, num_model_chunks=2) == SEED003_RANK0_ORDER
    assert schedule_order(8, 4, 0, 2, 4) == SEED003_RANK0_ORDER
    assert convert_schedule_table_to_order(10, 2, SEED003_TABLE) == SEED003_RANK0_ORDER


def test_seed003_rank0_steps_name_microbatches():
    f = lambda c, m: ScheduleStep(FORWARD, c, m)  # noqa: E731
    b = lambda c, m: ScheduleStep(BACKWARD, c, m)  # noqa: E731
    steps = schedule_steps(8, 4, 0, num_model_chunks=2)
    assert steps[:10] == [f(0, 0), f(0, 1), f(0, 2), f(0, 3), f(1, 0), f(1, 1), f(1, 2), f(1, 3),
                          f(0, 4), f(0, 5)]
    # 1F1B: the first backward is micro-batch 0 of the last chunk, where gradients enter.
    assert steps[10:22] == [f(0, 6), b(1, 0), f(0, 7), b(1, 1), f(1, 4), b(1, 2), f(1, 5), b(1, 3),
                            f(1, 6), b(0, 0), f(1, 7), b(0, 1)]
    assert steps[22:] == [b(0, 2), b(0, 3), b(1, 4), b(1, 5), b(1, 6), b(1, 7),
                          b(0, 4), b(0, 5), b(0, 6), b(0, 7)]
    assert [s.order_entry for s in steps] == SEED003_RANK0_ORDER


def test_seed003_no_pipelining_is_one_forward_one_backward():
    assert schedule_order(4, 1, 0) == [1, -1, 1, -1, 1, -1, 1, -1]


def test_seed003_all_forwards_then_all_backwards_when_warmup_covers_everything():
    # The seed's second pattern: on a rank whose warm-up is >= M, nothing is 1F1B.
    assert schedule_order(4, 5, 0) == [1, 1, 1, 1, -1, -1, -1, -1]
    assert get_pp_rank_microbatches(4, 1, None, 5, 0) == (4, True, 4, 0)


def test_megatron_tunable_table_with_short_last_group():
    # Megatron-Core's docstring example, PP2 N3 M5 VP2.
    table = get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    schedule_order(5, 2, 0, 2, 3)  # remainder 2 >= pp 2: accepted


def test_forward_only_runs_the_table_forwards():
    assert get_pp_rank_microbatches(8, 2, 4, 4, 3, forward_only=True) == (16, True, 16, 0)
    assert schedule_order(8, 4, 3, 2, forward_only=True) == [c + 1 for _, c in SEED003_TABLE]
    assert schedule_order(3, 2, 1, forward_only=True) == [1, 1, 1]


def test_non_interleaved_ignores_group_size():
    assert schedule_order(6, 3, 0, 1, 5) == schedule_order(6, 3, 0) == [1, 1, 1, -1, 1, -1, 1, -1,
                                                                          1, -1, -1, -1]


# --- properties over every valid configuration of a small grid ------------------------------------

def valid_configs(pp):
    """(chunks, M, group) for pp, M in 1..24: every group size the validation accepts up to 12,
    and M itself (one group); pp is passed as the default (None)."""
    for chunks in range(1, 5):
        for m in range(1, 25):
            if chunks == 1:
                yield chunks, m, None
                continue
            for g in sorted({*range(pp, min(m, 12) + 1), m}):
                if g >= pp and (m % g == 0 or m % g >= pp):
                    yield chunks, m, None if g == pp else g


def test_valid_configs_are_exactly_what_validation_accepts():
    for pp in range(1, 9):
        accepted = {(c, m, resolve_group_size(m, pp, c, g)) for c in range(2, 5)
                    for m in range(1, 25) for g in [None, *range(1, 26)] if _accepts(m, pp, c, g)}
        listed = {(c, m, resolve_group_size(m, pp, c, g)) for c, m, g in valid_configs(pp) if c > 1}
        assert listed == {(c, m, g) for c, m, g in accepted if g <= 12 or g == m}


def _accepts(m, pp, c, g):
    try:
        resolve_group_size(m, pp, c, g)
    except ParallelConfigError:
        return False
    return True


@pytest.mark.parametrize("pp", range(1, 9))
def test_order_properties(pp):
    for chunks, m, g in valid_configs(pp):
        table = get_schedule_table(m, chunks, resolve_group_size(m, pp, chunks, g))
        assert sorted(table) == [(mb, c) for mb in range(m) for c in range(chunks)]
        mirrored = [(mb, chunks - 1 - c) for mb, c in table]
        assert schedule_order(m, pp, 0, chunks, g) == [
            s.order_entry for s in schedule_steps(m, pp, 0, chunks, g)]
        for rank in range(pp):
            counts = get_pp_rank_microbatches(m, chunks, g, pp, rank)
            warmup, remaining = counts.num_warmup_microbatches, counts.num_microbatches_remaining
            steps = schedule_steps(m, pp, rank, chunks, g)
            order = [s.order_entry for s in steps]
            assert len(order) == 2 * m * chunks == 2 * counts.total_num_microbatches

            # forwards follow the table and backwards the mirrored table, so every
            # (micro-batch, chunk) is forwarded once and backwarded once
            assert [(s.microbatch, s.chunk) for s in steps if s.is_forward] == table
            assert [(s.microbatch, s.chunk) for s in steps if not s.is_forward] == mirrored

            # shape: warm-up forwards, alternating 1F1B, cool-down backwards
            assert min(order[warmup:warmup + 2 * remaining:2], default=1) > 0
            assert max(order[warmup + 1:warmup + 2 * remaining:2], default=-1) < 0
            assert max(order[warmup + 2 * remaining:], default=-1) < 0
            assert min(order[:warmup], default=1) > 0

            # each backward comes after its forward; activations alive at once never exceed
            # warm-up + 1 (seed 003's memory bound), and reach it
            alive, peak = set(), 0
            for s in steps:
                if s.is_forward:
                    alive.add((s.microbatch, s.chunk))
                    peak = max(peak, len(alive))
                else:
                    alive.remove((s.microbatch, s.chunk))
            assert peak == min(warmup + 1, counts.total_num_microbatches)

            if pp == 1 and chunks == 1:
                assert order == [1, -1] * m
            fwd_only = schedule_steps(m, pp, rank, chunks, g, forward_only=True)
            assert fwd_only == [(FORWARD, c, mb) for mb, c in table]


# --- a pipeline simulator: every rank runs its order; sends are asynchronous, receives block ---

class Deadlock(Exception):
    pass


def simulate(steps_per_rank, pp, chunks):
    """Run every rank's steps in order; return the finishing time of the last one.

    Each step takes one time unit and starts once its rank is free and its input has arrived:
    a forward of (micro-batch m, virtual stage v) needs forward (m, v-1), a backward of (m, v)
    needs backward (m, v+1), or on the last stage its own forward (which transitively covers
    every earlier stage's forward). Sends never block; a rank whose next step's input has not
    been produced waits, and if every unfinished rank waits, that is a deadlock.
    """
    last = pp * chunks - 1
    finish = {}
    jobs = [[(phase, virtual_stage(pp, rank, chunk), mb) for phase, chunk, mb in steps]
            for rank, steps in enumerate(steps_per_rank)]
    position, clock = [0] * pp, [0] * pp
    progress = True
    while progress:
        progress = False
        for rank, rank_jobs in enumerate(jobs):
            i, t = position[rank], clock[rank]
            while i < len(rank_jobs):
                phase, v, mb = job = rank_jobs[i]
                if phase == FORWARD:
                    needs = (FORWARD, v - 1, mb) if v > 0 else None
                else:
                    needs = (BACKWARD, v + 1, mb) if v < last else (FORWARD, v, mb)
                if needs is not None:
                    if needs not in finish:
                        break
                    t = max(t, finish[needs])
                t += 1
                finish[job] = t
                i += 1
            progress |= i > position[rank]
            position[rank], clock[rank] = i, t
    if any(position[r] < len(steps_per_rank[r]) for r in range(pp)):
        raise Deadlock(f"every rank waits; steps done per rank: {position}")
    return max(clock)


@pytest.mark.parametrize("pp", range(1, 9))
def test_simulated_pipeline_completes_with_only_the_startup_bubble(pp):
    for chunks, m, g in valid_configs(pp):
        steps = [schedule_steps(m, pp, r, chunks, g) for r in range(pp)]
        # one time unit per chunk step: 2*M*C of work per rank, plus the fill and drain of the
        # pipeline, 2 * (pp - 1) chunk steps (1/C of the non-interleaved bubble in stage time)
        assert simulate(steps, pp, chunks) == 2 * m * chunks + 2 * (pp - 1), (chunks, m, g)
        forward_only = [schedule_steps(m, pp, r, chunks, g, forward_only=True) for r in range(pp)]
        assert simulate(forward_only, pp, chunks) == m * chunks + pp - 1, (chunks, m, g)


def test_simulator_detects_a_deadlock():
    # rank 1 (last stage) waits for micro-batch 1, which rank 0 only sends after micro-batch 0's
    # gradient comes back from rank 1.
    f = lambda c, m: ScheduleStep(FORWARD, c, m)  # noqa: E731
    b = lambda c, m: ScheduleStep(BACKWARD, c, m)  # noqa: E731
    with pytest.raises(Deadlock):
        simulate([[f(0, 0), b(0, 0), f(0, 1), b(0, 1)], [f(0, 1), b(0, 1), f(0, 0), b(0, 0)]], 2, 1)


def test_rejected_group_sizes_would_stall_or_deadlock():
    """Why the interleaving rules exist: built anyway (same table and warm-up formula), every
    configuration they reject either deadlocks or runs longer than the ideal schedule."""
    checked = 0
    for pp in range(2, 6):
        for chunks in (2, 3):
            for m in range(pp, 13):
                for g in range(1, m + 1):
                    if _accepts(m, pp, chunks, g):
                        continue
                    table = get_schedule_table(m, chunks, g)
                    steps = []
                    for rank in range(pp):
                        warmup = min((pp - rank - 1) * 2 + (chunks - 1) * g, m * chunks)
                        steps.append(convert_schedule_table_to_steps(warmup, chunks, table))
                    try:
                        length = simulate(steps, pp, chunks)
                    except Deadlock:
                        length = None
                    ideal = 2 * m * chunks + 2 * (pp - 1)
                    assert length is None or length > ideal, (pp, chunks, m, g)
                    checked += 1
    assert checked > 300


# --- errors name the parameter and what would work ----------------------------------------------

def test_error_group_size_out_of_range():
    with pytest.raises(ParallelConfigError, match=r"microbatch_group_size_per_vp_stage=2 must lie "
                       r"in \[pp_size=4, num_microbatches=8\].*values that work for "
                       r"num_microbatches=8: 4, 8\."):
        schedule_order(8, 4, 0, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"microbatch_group_size_per_vp_stage=9 must lie"):
        get_pp_rank_microbatches(8, 2, 9, 4, 0)


def test_error_short_final_group_lists_valid_values():
    with pytest.raises(ParallelConfigError, match=(
            r"num_microbatches=10 leaves a final group of 2 micro-batches .*10 % 4.*pp_size=4\. "
            r"Megatron-Core requires that remainder to be 0 or >= pp_size.*dependency bubbles.*"
            r"Valid num_microbatches near 10 for group size 4: 4, 8, 12, 16; valid "
            r"microbatch_group_size_per_vp_stage for num_microbatches=10: 5, 6, 10\.")):
        schedule_order(10, 4, 0, num_model_chunks=2)


def test_error_too_few_microbatches_to_interleave():
    with pytest.raises(ParallelConfigError, match=r"num_microbatches=3 is smaller than pp_size=4.*"
                       r"num_microbatches >= 4 \(e\.g\. 4, 8\).*num_model_chunks=1"):
        schedule_order(3, 4, 0, num_model_chunks=2)
    assert len(schedule_order(3, 4, 0)) == 6  # fine without interleaving


def test_error_pp_rank_out_of_range():
    with pytest.raises(ParallelConfigError, match=r"pp_rank=4 is out of range for pp_size=4; "
                       r"valid values are 0\.\.3"):
        schedule_order(8, 4, 4)
    with pytest.raises(ParallelConfigError, match=r"pp_rank must be >= 0, got -1"):
        get_pp_rank_microbatches(8, 1, None, 4, -1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_microbatches=0), r"num_microbatches must be >= 1, got 0"),
    (dict(pp_size=2.0), r"pp_size must be an integer >= 1, got 2\.0 \(float\)"),
    (dict(num_model_chunks=True), r"num_model_chunks must be an integer >= 1, got True \(bool\)"),
    (dict(num_model_chunks=0), r"num_model_chunks must be >= 1, got 0"),
    (dict(microbatch_group_size_per_vp_stage=0), r"microbatch_group_size_per_vp_stage must be >= "),
])
def test_error_sizes_must_be_positive_ints(kwargs, match):
    args = dict(num_microbatches=8, pp_size=4, pp_rank=0, num_model_chunks=2) | kwargs
    with pytest.raises(ParallelConfigError, match=match):
        schedule_order(**args)


def test_error_table_and_convert_arguments():
    with pytest.raises(ParallelConfigError, match=r"microbatch_group_size_per_vp_stage must be >="):
        get_schedule_table(8, 2, 0)
    with pytest.raises(ParallelConfigError, match=r"num_warmup_microbatches must be >= 0"):
        convert_schedule_table_to_order(-1, 2, SEED003_TABLE)
    assert issubclass(ParallelConfigError, ValueError)
