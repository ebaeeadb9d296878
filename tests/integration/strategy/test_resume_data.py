"""Which batches a resumed run trains on, for loaders whose order is not Lightning's DistributedSampler's.

A probe found the resuming loader skipping batches of the wrong epoch when the sampler has no epoch: a
sequential loader (``use_distributed_sampler=False``) resumed from a checkpoint taken at an epoch's last
batch skipped the whole next epoch, and a shuffling one of the user's own was skipped into a different
permutation (some samples twice, some never). Sequential loaders now resume exactly (the trainer's epoch
fixes their order); loaders whose order cannot be replayed restart the epoch with a warning, as Lightning
does.
"""

import os
import warnings

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, fit_tiny_gpt


class IdsGPT(TinyGPT):
    """``probe``: each step's epoch and samples (their first token stands for them)."""

    def training_step(self, batch, batch_idx):
        self.sums = getattr(self, "sums", []) + [(self.current_epoch, batch["input_ids"][:, 0].tolist())]
        return super().training_step(batch, batch_idx)


def _run(max_steps, folder=None, resume_from=None, shuffle=False):
    """Four batches of 8 per epoch, the loader's own order (no DistributedSampler); ``folder``: a checkpoint
    after every step."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, RandomSampler

    from helpers.strategy_utils import TokenData

    world = os.environ["WORLD_SIZE"]
    callbacks = [ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")] \
        if folder else []
    data = TokenData(n=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if shuffle:   # the user's own shuffling sampler: its order is not a function of the epoch
            import lightning as L

            from lightning_megatron import MegatronStrategy

            L.seed_everything(0, verbose=False)
            module = IdsGPT()
            trainer = L.Trainer(strategy=MegatronStrategy(), accelerator="cpu", devices=1, max_steps=max_steps,
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                use_distributed_sampler=False, enable_checkpointing=bool(folder), callbacks=callbacks)
            trainer.fit(module, DataLoader(data, batch_size=8, sampler=RandomSampler(data)), ckpt_path=resume_from)
            ids = module.sums
        else:
            ids = fit_tiny_gpt(dict(), max_steps=max_steps, module_cls=IdsGPT, dataset=data, resume_from=resume_from,
                               trainer_kwargs=dict(use_distributed_sampler=False, enable_checkpointing=bool(folder),
                                                   callbacks=callbacks))["probe"]
    os.environ["WORLD_SIZE"] = world
    return ids, [str(w.message) for w in caught if "resum" in str(w.message).lower()]


def _sequential(folder):
    straight, _ = _run(8, folder)
    mid, mid_warned = _run(8, resume_from=os.path.join(folder, "step=2.ckpt"))
    end, end_warned = _run(8, resume_from=os.path.join(folder, "step=4.ckpt"))
    return straight, mid, end, mid_warned + end_warned


def test_a_sequential_loader_resumes_exactly_mid_epoch_and_at_an_epoch_end(tmp_path):
    straight, mid, end, warned = run_on_ranks(_sequential, 1, str(tmp_path / "ckpts"), timeout=240)[0]
    assert len(straight) == 8 and [ids for _, ids in straight[:4]] == [ids for _, ids in straight[4:]]
    assert [epoch for epoch, _ in straight] == [0] * 4 + [1] * 4
    assert mid == straight[2:]   # resumed two batches into epoch 0
    assert end == straight[4:]   # resumed at the end of epoch 0: the whole of epoch 1
    assert warned == []


def _own_shuffle(folder):
    _run(4, folder, shuffle=True)
    return _run(4, resume_from=os.path.join(folder, "step=2.ckpt"), shuffle=True)


def test_a_loader_whose_order_cannot_be_replayed_restarts_the_epoch_with_a_warning(tmp_path):
    ids, warned = run_on_ranks(_own_shuffle, 1, str(tmp_path / "ckpts"), timeout=240)[0]
    assert len(ids) == 2   # steps 3 and 4: Lightning's counters resume, the epoch's batches start again
    assert len(warned) == 1 and "2 batches are trained again" in warned[0], warned


def test_resuming_after_max_steps_stopped_an_epoch_warns_that_its_rest_is_not_trained(tmp_path):
    run_on_ranks(_save_at_two, 1, str(tmp_path / "stopped"), timeout=120)
    warned = run_on_ranks(_resume_from_stopped, 1, str(tmp_path / "stopped"), timeout=120)[0]
    assert len(warned) == 1 and "the rest of epoch 0 is not trained" in warned[0], warned


def _save_at_two(folder):
    fit_tiny_gpt(dict(), max_steps=2, module_cls=IdsGPT, dataset_size=32, checkpoint_to=folder)


def _resume_from_stopped(folder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_tiny_gpt(dict(), max_steps=4, module_cls=IdsGPT, dataset_size=32, resume_from=folder)
    return [str(w.message) for w in caught if "not trained" in str(w.message)]
