"""The multi-rank harness: results by rank, tracebacks from failing ranks, hangs and deaths caught."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.testing import MultiRankError, run_on_ranks


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


def init_process_group(flag):   # named like torch's: the harness recognises an init-time failure by it
    if not os.path.exists(flag):
        open(flag, "w").close()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")
    return dist.get_rank()


def _flaky_mesh(flag):
    if dist.get_rank() == 0:
        return init_process_group(flag)
    return dist.get_rank()


def _user_error_mentioning_mesh():
    raise RuntimeError("Gloo connectFullMesh failed (raised by the function itself)")


def test_a_lost_connection_while_the_world_starts_is_retried_once(tmp_path):
    assert run_on_ranks(_flaky_mesh, 2, str(tmp_path / "flag"), timeout=60) == [0, 1]


def test_failures_of_the_function_are_not_retried():
    with pytest.raises(MultiRankError, match="raised by the function itself"):
        run_on_ranks(_user_error_mentioning_mesh, 1, timeout=60)
