"""Background checkpoint saves (Lightning's ``AsyncCheckpointIO`` plugin): training goes on while shards are written,
resuming is bit for bit what a synchronous save gives, and a failed or killed write leaves the previous checkpoint."""

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_megatron.checkpoint import is_checkpoint, read_full_state_dict
from lightning_megatron.checkpoint.sharded import SaveJob
from lightning_megatron.testing import MultiRankError, run_on_ranks
from helpers.checkpoint_utils import assert_same
from helpers.strategy_utils import TinyGPT, fit_tiny_gpt

TP2 = dict(tensor_model_parallel_size=2)


class AdamGPT(TinyGPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(folder, max_steps, background, resume_from=None, callbacks=(), keep=-1):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    world = os.environ["WORLD_SIZE"]
    every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=keep, filename="{step}")
    options = dict(enable_checkpointing=True, callbacks=[every_step, *callbacks])
    if background:
        options["plugins"] = [AsyncCheckpointIO()]
    try:
        return fit_tiny_gpt(TP2, max_steps=max_steps, dataset_size=32, module_cls=AdamGPT,
                            module_kwargs=dict(dropout=0.1), trainer_kwargs=options, resume_from=resume_from)["losses"]
    finally:
        os.environ["WORLD_SIZE"] = world


class _HoldTheWrite:
    """Holds the background write of step 2's checkpoint until the training step after it has updated the parameters
    (Lightning runs ``ModelCheckpoint`` after the other callbacks' ``on_train_batch_end``): a save that blocked
    training would wait here for 60 s, then fail; one that wrote the live tensors would write step 3's."""

    def __init__(self):
        import lightning as L

        started, original = threading.Event(), SaveJob.write

        def held_write(job, group=None):
            if job.path.endswith("step=2.ckpt") and not started.wait(60):
                raise AssertionError("the save blocked training: step 3 never ended while step 2 was written")
            self.threads.add(threading.current_thread().name)
            original(job, group)

        class Started(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step >= 3:
                    started.set()

        self.threads, self.callback, self.write, self.original = set(), Started(), held_write, original


def _background_against_synchronous(root):
    hold = _HoldTheWrite()
    SaveJob.write = hold.write
    try:
        in_background = _fit(os.path.join(root, "background"), 6, True, callbacks=[hold.callback])
    finally:
        SaveJob.write = hold.original
    synchronous = _fit(os.path.join(root, "synchronous"), 6, False)
    resumed = _fit(os.path.join(root, "resumed"), 6, False, resume_from=os.path.join(root, "background", "step=3.ckpt"))
    return in_background, synchronous, resumed, sorted(hold.threads)


def test_background_saves_resume_like_synchronous_ones_bit_for_bit(tmp_path):
    """TP2, dropout on, AdamW: the folders, the straight runs and the run resumed from a background save are those
    of synchronous saves, bit for bit; the write ran in its own thread while the next step trained."""
    for in_background, synchronous, resumed, threads in run_on_ranks(_background_against_synchronous, 2,
                                                                     str(tmp_path), timeout=300):
        assert len(synchronous) == 6 and in_background == synchronous
        assert resumed == synchronous[3:]
        assert threads and all(name.startswith("lightning-megatron checkpoint") for name in threads)
    for step in range(1, 7):
        name = f"step={step}.ckpt"
        assert is_checkpoint(tmp_path / "background" / name)
        assert_same(read_full_state_dict(tmp_path / "background" / name),
                    read_full_state_dict(tmp_path / "synchronous" / name))
    assert not [n for n in os.listdir(tmp_path / "background") if n.endswith(".incomplete")]


def _failing_write(root, failing_step, how):
    """Rank 1's write of ``step=<failing_step>.ckpt`` fails (``how``: raise, or kill the process) while only the
    newest checkpoint is kept: the one before must survive."""
    original = dcp.FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        if os.environ["RANK"] == "1" and f"step={failing_step}.ckpt" in str(writer.path):
            if how == "kill":
                os._exit(3)
            raise OSError("disk full (simulated)")
        return original(writer, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    try:
        _fit(os.path.join(root, "ckpts"), 5, True, keep=1)
    except Exception as err:  # noqa: BLE001 - the background error, raised later on every rank
        return type(err).__name__, str(err)
    finally:
        dcp.FileSystemWriter.write_data = original
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
    with pytest.raises(MultiRankError, match="rank 1 exited with code 3"):
        run_on_ranks(_failing_write, 2, str(tmp_path), 3, "kill", timeout=300)
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert "step=3.ckpt" not in names and is_checkpoint(tmp_path / "ckpts" / "step=2.ckpt"), names
    for straight, resumed in run_on_ranks(_resume, 2, str(tmp_path), 2, timeout=300):
        assert resumed == straight[2:]


def _host_buffers_at_each_save(root):
    """What ``to_host`` finds at each background save: the host buffers already there (keys and identities) and
    the entries it snapshots; and the buffers after it."""
    from lightning_megatron.checkpoint import background

    seen, original = [], background.to_host

    def recording(entries, blobs, buffers, training_peak=None):
        before = {key: id(buffer) for key, buffer in buffers.items()}
        snapshot = original(entries, blobs, buffers, training_peak)
        seen.append((before, sorted(e.key for e in entries), {key: id(b) for key, b in buffers.items()}))
        return snapshot

    background.to_host = recording
    try:
        _fit(os.path.join(root, "ckpts"), 2, True)
    finally:
        background.to_host = original
    return seen


def test_the_host_buffers_are_made_after_the_first_optimizer_step_not_at_the_first_save(tmp_path):
    """With background saves the buffers every save copies into exist before the first save (made after the first
    optimizer step, every AdamW state included): no save makes one, and every save reuses the same buffers."""
    for seen in run_on_ranks(_host_buffers_at_each_save, 2, str(tmp_path), timeout=300):
        assert len(seen) == 2
        for before, keys, after in seen:
            assert any(".exp_avg_sq" in key for key in keys)
            assert sorted(before) == keys and before == after
        assert seen[0][2] == seen[1][2]
