"""The hang detector (``distributed/hang.py``, ``hang_report.py``, ``parallel/heartbeat.py``): a rank stalled in
Python or one that skipped a collective is named, with where every rank is, on every rank, within the configured
time; a healthy run with a short timeout is left alone. The multi-rank runs are real fits (gloo, 2 ranks) in which
every rank's stderr goes to a file the test reads."""

import os
import re
import time

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_megatron.distributed.hang import HangWatch
from lightning_megatron.distributed.hang_report import hang_message, is_stuck, rank_list, who_differs
from lightning_megatron.parallel.heartbeat import HEARTBEAT, Heartbeat, describe
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.testing.multiprocess import MultiRankError

from helpers.strategy_utils import fit_tiny_gpt

TIMEOUT_S = 3.0


def _rec(seq, waiting, where="x", python="f.py:1 in f", finished=False, ticks=1):
    return {"seq": seq, "waiting": waiting, "where": where, "python": python, "finished": finished, "ticks": ticks}


# --- the record and the pure verdict ------------------------------------------------------------------------


def test_the_heartbeat_says_where_a_rank_is():
    beat = Heartbeat()
    assert describe(beat.kind, beat.index, beat.inside, beat.action) == "setting up"
    beat.begin("training batch")
    beat.end()
    beat.begin("training batch")
    beat.at("backward", microbatch=2, stage=1)
    assert (beat.seq, beat.index) == (3, 1)
    assert describe(beat.kind, beat.index, beat.inside, beat.action, beat.microbatch, beat.chunk, beat.stage) == \
        "training batch 1, stage 1, micro-batch 2, backward"
    beat.end()
    beat.at("clipping: the gradient norm's all-reduce", waiting=True)
    assert describe(beat.kind, beat.index, beat.inside, beat.action) == \
        "after training batch 1, clipping: the gradient norm's all-reduce"
    assert describe("training batch", 1, False, None).startswith("after training batch 1 (between steps")
    beat.begin("evaluation batch")   # counted apart from training batches
    assert (beat.kind, beat.index, beat.seq) == ("evaluation batch", 0, 5)
    beat.reset()
    assert (beat.seq, beat.ticks) == (0, 0)


def test_who_differs():
    # a rank stalled in Python while the others wait for it in collectives
    assert who_differs({0: _rec(7, True), 1: _rec(6, False), 2: _rec(7, True), 3: _rec(7, True)}) == [1]
    # two ranks in different collectives: the one that went on skipped the other's
    assert who_differs({0: _rec(8, True), 1: _rec(9, True)}) == [1]
    # two ranks outside collectives (NCCL: hosts blocked at syncs): the one behind
    assert who_differs({0: _rec(9, False), 1: _rec(8, False)}) == [1]
    # one largest group of equal progress: the others differ
    assert who_differs({0: _rec(8, True), 1: _rec(9, True), 2: _rec(9, True), 3: _rec(9, True)}) == [0]
    # a rank whose run ended while the others' goes on
    assert who_differs({0: _rec(9, True), 1: _rec(10, False, finished=True)}) == [1]
    # everyone at one place
    assert who_differs({0: _rec(9, True), 1: _rec(9, True)}) == []
    # equal progress, different places: the odd one out, or all when none is
    assert who_differs({0: _rec(9, True), 1: _rec(9, True, python="b.py:2 in b"), 2: _rec(9, True)}) == [1]
    assert who_differs({0: _rec(9, True), 1: _rec(9, True, python="b.py:2 in b")}) == [0, 1]


def test_is_stuck_only_when_every_running_rank_is_quiet_and_every_rank_has_started():
    records = {0: _rec(3, True), 1: _rec(2, False)}
    assert is_stuck(records, {0: 5.0, 1: 5.0}, 5.0)
    assert not is_stuck(records, {0: 5.0, 1: 4.9}, 5.0)
    assert not is_stuck({0: _rec(3, True), 1: _rec(0, False)}, {0: 9.0, 1: 9.0}, 5.0)   # rank 1 still sets up
    assert is_stuck({0: _rec(3, True), 1: _rec(4, False, finished=True)}, {0: 9.0, 1: 0.0}, 5.0)
    assert not is_stuck({0: _rec(3, True, finished=True)}, {0: 9.0}, 5.0)


def test_the_message_names_who_differs_first_and_groups_ranks_at_one_place():
    records = {0: _rec(7, True, "training batch 3, forward", "c10d.py:9 in all_reduce"),
               1: _rec(6, False, "after training batch 2", "my.py:4 in on_train_batch_start"),
               2: _rec(7, True, "training batch 3, forward", "c10d.py:9 in all_reduce")}
    message = hang_message(records, 61.2, "X=60")
    assert message.startswith("lightning_megatron: the run is stuck: no rank has made progress for 61 s (X=60); "
                              "rank 1 differs from the others:\n"), message
    lines = message.splitlines()[1:]
    assert lines[0] == "  rank 1: after training batch 2; not in a collective; Python at my.py:4 in on_train_batch_start"
    assert lines[1] == "  ranks 0, 2: training batch 3, forward; waiting in a collective; Python at c10d.py:9 in all_reduce"
    assert rank_list([3, 1, 2, 0]) == "ranks 0-3"
    assert "no rank stands out" in hang_message({0: _rec(9, True), 1: _rec(9, True)}, 5, "X=5")
    assert "ranks 0, 1 are at different places:" in hang_message({0: _rec(9, True), 1: _rec(9, True, "y")}, 5, "X=5")


# --- the watch itself, twice in one process -------------------------------------------------------------------


def _two_watched_runs():
    said = []
    for run in range(2):
        watch = HangWatch(timeout_s=1.0, on_hang=said.append, poll_s=0.1).start()
        HEARTBEAT.begin("training batch")
        if run == 1 and dist.get_rank() == 1:
            time.sleep(3.0)   # stalled in Python; rank 0 waits in the barrier
        dist.barrier()
        HEARTBEAT.end()
        watch.stop()
        dist.barrier()
    return said


def test_a_second_run_in_one_process_is_watched_afresh_and_the_verdict_reaches_every_rank():
    out = run_on_ranks(_two_watched_runs, 2, timeout=60)
    for said in out:
        assert len(said) == 1 and "rank 1 differs from the others" in said[0], said
        assert "training batch 0" in said[0] and "in _two_watched_runs" in said[0], said
    assert out[0] == out[1]
    assert run_on_ranks(_watch_started, 1, timeout=60) == [False]   # one process alone: no watch


def _one_rank_goes_silent():
    said = []
    watch = HangWatch(timeout_s=60.0, on_hang=said.append, poll_s=0.1, dead_after_s=1.0).start()
    HEARTBEAT.begin("training batch")
    time.sleep(2.5)                        # both publish: a rank that answers is never called dead
    heard_early = list(said)
    dist.barrier()
    if dist.get_rank() == 1:               # its publisher dies without a word, as under SIGKILL
        def gone(*args, **kwargs):
            raise OSError("killed")
        watch._record = gone
    deadline = time.time() + 10
    while not said and time.time() < deadline:
        time.sleep(0.1)
    watch.stop()
    dist.barrier()
    return heard_early, said


def test_a_rank_whose_watcher_stopped_answering_is_called_gone_on_every_other_rank():
    (early0, said0), (early1, said1) = run_on_ranks(_one_rank_goes_silent, 2, timeout=60)
    assert early0 == [] and early1 == []
    assert len(said0) == 1 and "rank 1 stopped answering for 1 s" in said0[0], said0
    assert "last seen training batch 0" in said0[0], said0
    assert said1 == []                     # the silent rank's own watcher is gone


def _sigterm_while_blocked_then_a_peer_goes_silent():
    """Rank 0's main thread blocks in a collective rank 1 joins 4 s later; a thread sends rank 0 SIGTERM meanwhile.
    Then rank 1's watcher goes silent: with SIGTERM seen, rank 0 calls it gone after 3 s, not the 30 s set."""
    import signal
    import threading

    from lightning_megatron.distributed.sigterm import SigtermSeen

    rank, said, handled, seen_at = dist.get_rank(), [], [], []
    seen = SigtermSeen()
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *args: handled.append(time.monotonic()))   # as Lightning's handler
        assert seen.install()

        def terminate_and_look():
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not seen.seen():
                time.sleep(0.05)
            seen_at.append((seen.seen(), list(handled)))
        threading.Thread(target=terminate_and_look, daemon=True).start()
    else:
        time.sleep(4)
    dist.barrier()                          # rank 0 waits here, in C++, while the signal arrives
    watch = HangWatch(timeout_s=60.0, on_hang=said.append, poll_s=0.1, dead_after_s=30.0,
                      sigterm_seen=seen.seen).start()
    HEARTBEAT.begin("training batch")
    time.sleep(1.0)
    dist.barrier()
    if rank == 1:
        watch._record = lambda *args, **kwargs: (_ for _ in ()).throw(OSError("killed"))
    silent_from = time.monotonic()
    deadline = silent_from + 12
    while not said and time.monotonic() < deadline:
        time.sleep(0.1)
    took = time.monotonic() - silent_from
    watch.stop()
    dist.barrier()
    return said, seen_at, bool(handled), took


def test_after_sigterm_a_silent_peer_is_called_gone_within_seconds():
    (said0, seen_at, handled, took), (said1, _, _, _) = run_on_ranks(
        _sigterm_while_blocked_then_a_peer_goes_silent, 2, timeout=90)
    # seen from another thread while the main thread was still blocked (its Python handler had not run yet)
    assert seen_at == [(True, [])], seen_at
    assert handled                          # and the handler ran once the collective returned
    assert len(said0) == 1 and "rank 1 stopped answering for 3 s (after this process was sent SIGTERM" in said0[0]
    assert took < 15, took                  # not the 30 s of dead_after_s (3 s expected; slack for a loaded CI)
    assert said1 == []


def _watch_started():
    watch = HangWatch(timeout_s=1.0).start()
    return watch._thread is not None


# --- real fits on two ranks ------------------------------------------------------------------------------------


class _Stall(L.Callback):
    """Rank 1 sleeps in Python at the start of training batch 3 (and writes the time first)."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 3 and trainer.global_rank == 1:
            with open(os.path.join(self.out, "fault"), "w") as f:
                f.write(repr(time.time()))
            time.sleep(60)


class _SkipCollective(L.Callback):
    """Before training batch 4 rank 0 joins an all-reduce on a group of both ranks that rank 1 skips."""

    def __init__(self, out):
        self.out, self.group = out, None

    def on_train_start(self, trainer, module):
        self.group = dist.new_group([0, 1])

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx != 4:
            return
        if trainer.global_rank == 1:
            with open(os.path.join(self.out, "fault"), "w") as f:
                f.write(repr(time.time()))
            return
        dist.all_reduce(torch.ones(1), group=self.group)


class _AllPause(L.Callback):
    """Every rank pauses a little less than the timeout, twice (legitimately slow, everywhere alike): the run lasts
    longer than the timeout, so a watch blind to progress would fire."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step in (4, 9):
            time.sleep(TIMEOUT_S * 0.6)


def _fit(out, strategy, callback, max_steps=12, timeout_s=TIMEOUT_S, val=False):
    os.environ.update(LIGHTNING_MEGATRON_HANG_TIMEOUT_S=str(timeout_s), LIGHTNING_MEGATRON_EXIT_AFTER_FAILURE_S="1")
    err = os.open(os.path.join(out, f"rank{os.environ['RANK']}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)   # what this rank prints, for the test to read
    from helpers.strategy_utils import TokenData
    from torch.utils.data import DataLoader

    trainer_kwargs = dict(callbacks=[callback])
    if val:
        trainer_kwargs.update(val_check_interval=4, limit_val_batches=2)
    out = fit_tiny_gpt(strategy, max_steps=max_steps, trainer_kwargs=trainer_kwargs,
                       val_dataloader=DataLoader(TokenData(n=16), batch_size=4) if val else None)
    if val:   # a second fit in this process: a new run of the watch, its batches counted anew
        os.environ.setdefault("WORLD_SIZE", "2")   # the first fit's teardown took it
        fit_tiny_gpt(strategy, max_steps=6, trainer_kwargs=dict(callbacks=[callback]))
    return out


def _stderr(out, rank):
    with open(os.path.join(out, f"rank{rank}.err")) as f:
        return f.read()


def _message(text):
    start = text.index("lightning_megatron: the run is stuck")
    return text[start:text.index("\nrank ", start)]


def _hang(tmp_path, strategy, callback):
    out = str(tmp_path)
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_fit, 2, out, strategy, callback, timeout=90, init_process_group=False)
    fault = float((tmp_path / "fault").read_text())
    texts = [_stderr(out, rank) for rank in range(2)]
    for text in texts:
        assert "the run is stuck" in text, (str(info.value)[-3000:], texts)
    messages = [_message(text) for text in texts]
    assert messages[0] == messages[1]   # one verdict, the same on every rank
    said_at = max(os.path.getmtime(os.path.join(out, f"rank{r}.err")) for r in range(2))
    assert "2 of 2 ranks failed" in str(info.value), str(info.value)   # every rank ended, none finished the fit
    for rank in range(2):
        assert f"rank {rank} stops (exit status 1)" in texts[rank]
        # It exits with status 1 when its grace ends, unless the collective it was blocked in failed first because
        # its peer had already exited (gloo: "Connection closed by peer"): either way after the verdict was said.
        said = str(info.value).split(f"--- rank {rank} ---", 1)[1].split("--- rank", 1)[0]
        assert f"rank {rank} exited with code 1" in said or "Connection closed by peer" in said, said
    return messages[0], said_at - fault


def test_a_rank_stalled_in_python_is_named_on_every_rank(tmp_path):
    message, after = _hang(tmp_path, dict(pipeline_model_parallel_size=2, micro_batch_size=2), _Stall(str(tmp_path)))
    assert "; rank 1 differs from the others:" in message, message
    assert re.search(r"\n  rank 1: after training batch 2 \(between steps.*\); not in a collective; Python at "
                     r"distributed/test_hang_watch\.py:\d+ in on_train_batch_start", message), message
    assert re.search(r"\n  rank 0: training batch 3, stage 0, micro-batch \d, .*; waiting in a collective", message), \
        message
    assert TIMEOUT_S <= after < TIMEOUT_S + 6, after   # the detection time, plus slack for a loaded 2-core CI
    print(message)
    print(f"stall named {after:.1f} s after the fault (timeout {TIMEOUT_S} s)")


def test_a_rank_that_skipped_a_collective_is_named_with_where_each_rank_is(tmp_path):
    message, after = _hang(tmp_path, dict(tensor_model_parallel_size=2), _SkipCollective(str(tmp_path)))
    assert "; rank 1 differs from the others:" in message, message
    assert re.search(r"\n  rank 1: training batch 4, micro-batch 0, forward; waiting in a collective; Python at "
                     r"distributed/distributed_c10d\.py:\d+ in all_reduce", message), message
    assert re.search(r"\n  rank 0: after training batch 3 \(between steps.*\); waiting in a collective; Python at "
                     r"distributed/distributed_c10d\.py:\d+ in all_reduce \(from distributed/test_hang_watch\.py:\d+ "
                     r"in on_train_batch_start\)", message), message
    assert TIMEOUT_S <= after < TIMEOUT_S + 6, after   # the detection time, plus slack for a loaded 2-core CI
    print(message)
    print(f"skipped collective named {after:.1f} s after the fault (timeout {TIMEOUT_S} s)")


def test_a_healthy_run_with_a_short_timeout_is_left_alone(tmp_path):
    out = str(tmp_path)
    started = time.monotonic()
    results = run_on_ranks(_fit, 2, out, dict(pipeline_model_parallel_size=2, micro_batch_size=2), _AllPause(),
                           16, TIMEOUT_S, True, timeout=120)
    assert len(results[0]["losses"]) == 16
    for rank in range(2):
        assert "stuck" not in _stderr(out, rank), _stderr(out, rank)
    assert time.monotonic() - started > 2 * TIMEOUT_S   # the watch ran longer than its timeout
