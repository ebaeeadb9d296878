"""Background checkpoint saves (Lightning's ``AsyncCheckpointIO`` plugin): training goes on while shards are written,
resuming is bit for bit what a synchronous save gives, the shards are written by a process of their own, and a
failed or killed write leaves the previous checkpoint."""

import functools
import os
import signal
import time

import pytest
import torch.distributed.checkpoint as dcp

from lightning_megatron.checkpoint import is_checkpoint, read_full_state_dict, writer_process
from lightning_megatron.testing import MultiRankError, run_on_ranks
from helpers.checkpoint_utils import assert_same
from helpers.fault_runs import alive
from helpers.strategy_utils import fit_saving_every_step

TP2 = dict(tensor_model_parallel_size=2)


_fit = fit_saving_every_step


def _say_who_writes(root):
    """Run in each writing process: leave its pid in ``writer.<rank>``."""
    with open(os.path.join(root, f"writer.{os.environ['RANK']}"), "w") as out:
        out.write(str(os.getpid()))


def _hold_the_second_snapshot(root):
    """The second save's (step 2's) copy to the host slab, done by the training process's writing thread, waits
    until training has ended step 3 (Lightning runs ``ModelCheckpoint`` after the other callbacks'
    ``on_train_batch_end``). A save that blocked training would wait here for 60 s, then fail; one that copied the
    live tensors there instead of snapshotting them at the save would write step 3's state."""
    from lightning_megatron.checkpoint import background

    original, calls = background.to_host, []
    signal_file = os.path.join(root, f"step-3-ended.{os.environ['RANK']}")

    def held(*args, **kwargs):
        snapshot = original(*args, **kwargs)
        calls.append(1)
        if len(calls) != 2:
            return snapshot

        def land():
            deadline = time.monotonic() + 60
            while not os.path.exists(signal_file):
                if time.monotonic() > deadline:
                    raise AssertionError("the save blocked training: step 3 never ended while step 2 was written")
                time.sleep(0.01)
            snapshot.land()
        return snapshot._replace(land=land)

    background.to_host = held
    return original


def _step_3_ended(root):
    import lightning as L

    class Ended(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step >= 3:
                open(os.path.join(root, f"step-3-ended.{os.environ['RANK']}"), "w").close()
    return Ended()


def _background_against_synchronous(root):
    from lightning_megatron.checkpoint import background

    writer_process.CHILD_SETUP = functools.partial(_say_who_writes, root)
    original = _hold_the_second_snapshot(root)
    try:
        in_background = _fit(os.path.join(root, "background"), 6, True, callbacks=[_step_3_ended(root)])
    finally:
        writer_process.CHILD_SETUP, background.to_host = None, original
    with open(os.path.join(root, f"writer.{os.environ['RANK']}")) as written_by:
        writer = int(written_by.read())
    synchronous = _fit(os.path.join(root, "synchronous"), 6, False)
    resumed = _fit(os.path.join(root, "resumed"), 6, False, resume_from=os.path.join(root, "background", "step=3.ckpt"))
    return in_background, synchronous, resumed, writer, os.getpid()


def test_background_saves_resume_like_synchronous_ones_bit_for_bit(tmp_path):
    """TP2, dropout on, AdamW: the folders, the straight runs and the run resumed from a background save are those
    of synchronous saves, bit for bit; the write ran in a process of its own while the next step trained."""
    for in_background, synchronous, resumed, writer, trainer in run_on_ranks(_background_against_synchronous, 2,
                                                                             str(tmp_path), timeout=300):
        assert len(synchronous) == 6 and in_background == synchronous
        assert resumed == synchronous[3:]
        assert writer != trainer   # written by the writing process, not a thread of the training process
    for step in range(1, 7):
        name = f"step={step}.ckpt"
        assert is_checkpoint(tmp_path / "background" / name)
        assert_same(read_full_state_dict(tmp_path / "background" / name),
                    read_full_state_dict(tmp_path / "synchronous" / name))
    assert not [n for n in os.listdir(tmp_path / "background") if n.endswith(".incomplete")]


def _fail_in_the_writer(root, failing_step, how):
    """Run in each writing process: rank 1's write of ``step=<failing_step>.ckpt`` fails (``how``: raise, or kill
    the training process, whose writer must then end too; its pid is left in ``writer.1``)."""
    original = dcp.FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        if os.environ["RANK"] == "1" and f"step={failing_step}.ckpt" in str(writer.path):
            if how == "kill":
                with open(os.path.join(root, "writer.1"), "w") as out:
                    out.write(str(os.getpid()))
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(60)
            raise OSError("disk full (simulated)")
        return original(writer, plan, planner)

    dcp.FileSystemWriter.write_data = write_data


def _failing_write(root, failing_step, how):
    """Rank 1's write of ``step=<failing_step>.ckpt`` fails while only the newest checkpoint is kept: the one
    before must survive."""
    writer_process.CHILD_SETUP = functools.partial(_fail_in_the_writer, root, failing_step, how)
    try:
        _fit(os.path.join(root, "ckpts"), 5, True, keep=1)
    except Exception as err:  # noqa: BLE001 - the background error, raised later on every rank
        return type(err).__name__, str(err)
    finally:
        writer_process.CHILD_SETUP = None
    return None


def _resume(root, step):
    straight = _fit(os.path.join(root, "straight"), 5, False)
    return straight, _fit(os.path.join(root, "resumed"), 5, False,
                          resume_from=os.path.join(root, "ckpts", f"step={step}.ckpt"))


@pytest.mark.parametrize("failing_step, raised_at", [(3, "the next save"), (5, "the end of fit")])
def test_a_background_write_that_fails_is_raised_later_and_keeps_the_previous_checkpoint(tmp_path, failing_step,
                                                                                         raised_at):
    out = run_on_ranks(_failing_write, 2, str(tmp_path), failing_step, "raise", timeout=300)
    assert out[0] == out[1] and out[0] is not None, raised_at   # never lost, the same on every rank
    kind, message = out[0]
    assert kind == "CheckpointError" and "background save" in message and "disk full" in message
    assert f"step={failing_step}.ckpt" in message
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert f"step={failing_step - 1}.ckpt" in names and f"step={failing_step}.ckpt" not in names, names
    assert is_checkpoint(tmp_path / "ckpts" / f"step={failing_step - 1}.ckpt")


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    with pytest.raises(MultiRankError, match="rank 1 exited with code -9"):
        run_on_ranks(_failing_write, 2, str(tmp_path), 3, "kill", timeout=300)
    writer = int((tmp_path / "writer.1").read_text())
    deadline = time.monotonic() + 10
    while alive(writer):   # its training process is gone: the writer ends without committing
        assert time.monotonic() < deadline, "the writing process outlived its training process"
        time.sleep(0.1)
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert "step=3.ckpt" not in names and is_checkpoint(tmp_path / "ckpts" / "step=2.ckpt"), names
    for straight, resumed in run_on_ranks(_resume, 2, str(tmp_path), 2, timeout=300):
        assert resumed == straight[2:]


def _host_buffers_at_each_save(root):
    """What the background saver did, in order: ``("call",)`` at each save call, ``("slab", id, keys, pinned)`` for
    each host slab made, ``("collect",)`` for each time it collected the entries, ``("save", id of the slab used)``
    for each snapshot."""
    from lightning_megatron.checkpoint import background, host_slab, tensor_cache

    seen = []
    originals = host_slab.HostSlab.__init__, tensor_cache.collect_tensors, background.to_host
    save = background.BackgroundSaver.save

    def calling(*args, **kwargs):
        seen.append(("call",))
        return save(*args, **kwargs)

    def making(slab, layout, **kwargs):
        originals[0](slab, layout, **kwargs)
        seen.append(("slab", id(slab), sorted(layout.slots), slab.pinned))

    def collecting(*args):
        seen.append(("collect",))
        return originals[1](*args)

    def saving(entries, blobs, slab, *args):
        seen.append(("save", id(slab)))
        return originals[2](entries, blobs, slab, *args)

    host_slab.HostSlab.__init__, tensor_cache.collect_tensors, background.to_host = making, collecting, saving
    background.BackgroundSaver.save = calling
    try:
        _fit(os.path.join(root, "ckpts"), 2, True)
    finally:
        host_slab.HostSlab.__init__, tensor_cache.collect_tensors, background.to_host = originals
        background.BackgroundSaver.save = save
    return seen


def test_the_host_buffers_are_made_after_the_first_optimizer_step_not_at_the_first_save(tmp_path):
    """With background saves the host slab every save copies into exists before the first save (made after the first
    optimizer step, every AdamW state included): no save makes one, and every save reuses the same one. The entries
    are collected once too: the saves find the same tensors and reuse them."""
    for seen in run_on_ranks(_host_buffers_at_each_save, 2, str(tmp_path), timeout=300):
        assert [event[0] for event in seen] == ["collect", "slab", "call", "save", "call", "save"], seen
        _, made, keys, pinned = seen[1]
        assert any(".exp_avg_sq" in key for key in keys) and not pinned   # CPU training: nothing to pin
        assert seen[3][1] == seen[5][1] == made
