"""The multi-rank harness: results by rank, tracebacks from failing ranks, hangs and deaths caught."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.testing import MultiRankError, run_on_ranks
from lightning_megatron.testing.multiprocess import MESH_RETRIES


def _rank_sum(scale):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t * scale}


def _fail_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    dist.barrier()  # peers block here: the harness must not wait for the full timeout
    return dist.get_rank()


def _hang_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    return dist.get_rank()


def _die_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


def _env_only():
    return (dist.is_initialized(), os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"])


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_results_come_back_by_rank(world_size):
    out = run_on_ranks(_rank_sum, world_size, 2.0, timeout=60)
    expected = 2.0 * sum(range(world_size))
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["world"] == world_size and o["sum"].item() == expected for o in out)


def test_exception_on_one_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_fail_on_rank, 4, 2, timeout=60)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "--- rank 2 ---" in message and "ValueError: boom on rank 2" in message
    assert "_fail_on_rank" in message  # the traceback, not just the message


def test_hang_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(MultiRankError, match=r"ranks \[1\] of 2 did not finish within 4 s"):
        run_on_ranks(_hang_on_rank, 2, 1, timeout=4)
    assert time.monotonic() - start < 20


def test_rank_that_dies_silently_is_reported_with_its_exit_code():
    with pytest.raises(MultiRankError, match="rank 1 exited with code 3 without reporting"):
        run_on_ranks(_die_on_rank, 2, 1, timeout=30)


def test_launcher_mode_leaves_initialization_to_the_caller():
    out = run_on_ranks(_env_only, 2, timeout=30, init_process_group=False)
    assert [o[:3] for o in out] == [(False, "0", "2"), (False, "1", "2")]
    assert out[0][3] == out[1][3]


@pytest.mark.parametrize("bad", [0, 9, 2.0, True])
def test_world_size_is_validated(bad):
    with pytest.raises(ValueError, match="world_size must be an integer in \\[1, 8\\]"):
        run_on_ranks(_env_only, bad)


# The RuntimeError gloo raises when a pair of its TCP mesh cannot connect (torch 2.13, a peer gone):
GLOO_MESH_ERROR = ("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                   "pair.h:311] Connect timeout [none]")


def _attempt(log):
    """Number this rank's attempt (1, 2, ...) by appending to a file of its own that outlives the ranks."""
    path = f"{log}.rank{os.environ['RANK']}"
    with open(path, "a") as f:
        f.write("x")
    with open(path) as f:
        return len(f.read())


def _attempts(log, world_size):
    return [len((log.parent / f"{log.name}.rank{rank}").read_text()) for rank in range(world_size)]


def _break_gloo_mesh():
    """Make the next gloo group fail inside torch.distributed the way gloo does, in this rank's process only."""
    import torch.distributed.distributed_c10d as c10d

    def refuse(*args, **kwargs):
        raise RuntimeError(GLOO_MESH_ERROR)

    c10d.ProcessGroupGloo = refuse


def _mesh_fails_in_new_group(log, failing_attempts):
    """Rank 0's gloo mesh breaks inside ``dist.new_group`` (as ParallelState calls it) on the first
    ``failing_attempts`` attempts; its peers are left waiting in the same new_group."""
    if dist.get_rank() == 0 and _attempt(log) <= failing_attempts:
        _break_gloo_mesh()
    group = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _mesh_fails_in_init_process_group(log):
    """Launcher mode: the failure comes out of ``init_process_group`` (the caller's own, as Lightning's)."""
    if _attempt(log) == 1:
        _break_gloo_mesh()
    dist.init_process_group("gloo")
    return dist.get_rank()


def _genuine_error_on_first_attempt(log):
    if _attempt(log) == 1:
        raise ValueError("a genuine failure")
    return dist.get_rank()


def _mesh_message_raised_by_the_function(log):
    if _attempt(log) == 1:   # the gloo text, but from the function itself, not from torch.distributed
        raise RuntimeError(GLOO_MESH_ERROR)
    return dist.get_rank()


def test_mesh_failure_inside_new_group_is_retried_with_a_fresh_world(tmp_path):
    log = tmp_path / "attempts"
    assert run_on_ranks(_mesh_fails_in_new_group, 2, str(log), 1, timeout=60) == [2, 2]
    assert _attempts(log, 1) == [2]   # rank 0 ran twice: the whole run was started again


def test_mesh_failure_inside_init_process_group_is_retried(tmp_path):
    log = tmp_path / "attempts"
    assert run_on_ranks(_mesh_fails_in_init_process_group, 1, str(log), timeout=60, init_process_group=False) == [0]
    assert _attempts(log, 1) == [2]


def test_mesh_failure_is_retried_a_bounded_number_of_times_then_reported(tmp_path):
    log = tmp_path / "attempts"
    with pytest.raises(MultiRankError, match=r"connectFullMesh failed on all 3 attempts") as info:
        run_on_ranks(_mesh_fails_in_new_group, 1, str(log), 99, timeout=60)
    assert "Gloo connectFullMesh failed with" in str(info.value) and "new_group" in str(info.value)
    assert _attempts(log, 1) == [1 + MESH_RETRIES]


def _mesh_failure_beside_a_genuine_error(log):
    """Attempt 1: rank 0's group setup loses gloo's mesh while rank 1's function fails by itself (seen once in
    a loaded full-suite run: the run was retried, which could have hidden rank 1's failure)."""
    if _attempt(log) == 1:
        if dist.get_rank() == 0:
            _break_gloo_mesh()
            dist.new_group([0])
        raise ValueError("a genuine failure")
    return dist.get_rank()


@pytest.mark.parametrize("fn, message", [
    (_genuine_error_on_first_attempt, "ValueError: a genuine failure"),
    (_mesh_failure_beside_a_genuine_error, "ValueError: a genuine failure"),
    (_mesh_message_raised_by_the_function, "RuntimeError: Gloo connectFullMesh failed with"),
])
def test_failures_of_the_function_are_not_retried(tmp_path, fn, message):
    log = tmp_path / "attempts"   # the second attempt would succeed: only a retry could hide the failure
    with pytest.raises(MultiRankError, match=message):
        run_on_ranks(fn, 2, str(log), timeout=60)
    assert _attempts(log, 2) == [1, 1]
