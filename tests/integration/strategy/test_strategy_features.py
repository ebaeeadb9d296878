"""Strategy behaviour beyond equal losses: registry, metrics, validation, accumulation, precision,
checkpoints, and errors raised the same way on every rank."""

import os
import time
from datetime import timedelta

import lightning as L
import pytest
import torch

import lightning_megatron
from lightning_megatron import MegatronStrategy
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import (AdamGPT, TinyGPT, TokenData, assert_same_updates, fit_and_record, fit_tiny_gpt,
                                    validate_tiny_gpt)
from torch.utils.data import DataLoader


def _registered():
    trainer = L.Trainer(strategy="megatron", accelerator="cpu", devices=1, logger=False)
    return type(trainer.strategy).__name__


def test_strategy_name_is_registered():
    assert "megatron" in L.pytorch.strategies.StrategyRegistry
    assert run_on_ranks(_registered, 1, timeout=60) == ["MegatronStrategy"]


@pytest.mark.parametrize("world, kwargs", [(4, dict(tensor_model_parallel_size=2)),
                                           (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2))])
def test_validation_metrics_equal_single_process(world, kwargs):
    ref = run_on_ranks(validate_tiny_gpt, 1, dict(), timeout=120)[0]
    out = run_on_ranks(validate_tiny_gpt, world, kwargs, timeout=180)
    for metrics in out:
        assert metrics["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
        # torchmetrics syncs over data-parallel replicas only, and under PP every stage's copy holds the last
        # stage's states: the exact epoch accuracy
        assert metrics["val_acc"] == pytest.approx(ref["val_acc"], abs=1e-7)


@pytest.mark.parametrize("world, kwargs", [(1, dict(micro_batch_size=4)),
                                           (2, dict(pipeline_model_parallel_size=2, micro_batch_size=4)),
                                           (2, dict(pipeline_model_parallel_size=2, micro_batch_size=4,
                                                    virtual_pipeline_model_parallel_size=2))])
def test_ragged_last_validation_batch_counts_every_sample(world, kwargs):
    """30 samples in batches of 8: the last batch of 6 runs as micro-batches of 4 and 2 (it raised), and
    its loss is their mean weighted by samples, as one process computes it over the 6."""
    ref = run_on_ranks(validate_tiny_gpt, 1, dict(), dataset_size=30, timeout=120)[0]
    out = run_on_ranks(validate_tiny_gpt, world, kwargs, dataset_size=30, timeout=180)
    for metrics in out:
        assert metrics["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)
        if world == 1:
            assert metrics["val_acc"] == pytest.approx(ref["val_acc"], abs=1e-7)


def test_sanity_check_and_validation_run_under_pipeline():
    kwargs = dict(pipeline_model_parallel_size=2, micro_batch_size=2)
    val = DataLoader(TokenData(n=16, seed=1), batch_size=4)
    ref = run_on_ranks(fit_tiny_gpt, 1, dict(), trainer_kwargs=dict(num_sanity_val_steps=2, val_check_interval=2),
                       val_dataloader=val, timeout=120)[0]
    out = run_on_ranks(fit_tiny_gpt, 2, kwargs, trainer_kwargs=dict(num_sanity_val_steps=2, val_check_interval=2),
                       val_dataloader=val, timeout=180)
    for rank_out in out:
        assert rank_out["logged"]["val_loss"] == pytest.approx(ref["logged"]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("world, kwargs", [(2, dict(pipeline_model_parallel_size=2, micro_batch_size=1)),
                                           (2, dict()),
                                           # graphed layers add into the gradients the batch before left
                                           (2, dict(micro_batch_size=1, cuda_graph="partial",
                                                    cuda_graph_scope="block", cuda_graph_backend="eager"))],
                         ids=["pp2", "dp2", "dp2-block-graphs"])
def test_gradient_accumulation_across_batches(world, kwargs):
    trainer_kwargs = dict(accumulate_grad_batches=2)
    ref = run_on_ranks(fit_tiny_gpt, 1, dict(), global_batch_size=4, trainer_kwargs=trainer_kwargs,
                       max_steps=3, timeout=120)[0]
    out = run_on_ranks(fit_tiny_gpt, world, kwargs, global_batch_size=4, trainer_kwargs=trainer_kwargs,
                       max_steps=3, timeout=180)
    assert len(ref["losses"]) == 6
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_low_precision_matches_single_process(precision):
    trainer_kwargs = dict(precision=precision)
    ref = run_on_ranks(fit_tiny_gpt, 1, dict(), trainer_kwargs=trainer_kwargs, max_steps=2, timeout=120)[0]
    out = run_on_ranks(fit_tiny_gpt, 2, dict(tensor_model_parallel_size=2), trainer_kwargs=trainer_kwargs,
                       max_steps=2, timeout=180)
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(ref["losses"], rel=2e-2)


LAYOUTS = [(2, dict()), (2, dict(tensor_model_parallel_size=2)), (2, dict(pipeline_model_parallel_size=2,
           micro_batch_size=2)), (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
           micro_batch_size=2)), (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
           micro_batch_size=2)), (4, dict(tensor_model_parallel_size=2))]


def _save_and_resume(kwargs, folder):
    world = os.environ["WORLD_SIZE"]
    first = fit_tiny_gpt(kwargs, max_steps=2, checkpoint_to=folder, dataset_size=16)
    os.environ["WORLD_SIZE"] = world   # Lightning's teardown removes it; a second Trainer needs it
    resumed = fit_tiny_gpt(kwargs, max_steps=4, resume_from=folder, dataset_size=16)
    return first["losses"], resumed["losses"]


@pytest.mark.parametrize("world, kwargs", LAYOUTS)
def test_save_checkpoint_and_resume_under_every_layout(tmp_path, world, kwargs):
    """Resuming continues exactly as one process resuming the same checkpoint does."""
    ref_first, ref_resumed = run_on_ranks(_save_and_resume, 1, {}, str(tmp_path / "ref"), timeout=120)[0]
    out = run_on_ranks(_save_and_resume, world, kwargs, str(tmp_path / "ckpt"), timeout=180)
    for first, resumed in out:
        assert first == pytest.approx(ref_first, rel=1e-5)
        assert len(resumed) == 2 and resumed == pytest.approx(ref_resumed, rel=1e-5)


def _fit_error(kwargs, trainer_kwargs=None, global_batch_size=8):
    try:
        fit_tiny_gpt(kwargs, global_batch_size=global_batch_size, trainer_kwargs=trainer_kwargs)
    except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("world, kwargs, trainer_kwargs, batch, match", [
    (3, dict(tensor_model_parallel_size=2), None, 6, "world_size=3 (the number of processes: devices × num_nodes) is not divisible by tensor_model_parallel_size"),
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=3), None, 8,
     "micro_batch_size=3 does not divide"),
    (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, micro_batch_size=4), None, 4,
     "num_microbatches"),
    (2, dict(tensor_model_parallel_size=2), dict(precision="64-true"), 8, "precision='64-true' is not supported"),
    (2, dict(tensor_model_parallel_size=0), None, 8, "tensor_model_parallel_size must be >= 1"),
])
def test_invalid_configuration_raises_the_same_error_on_every_rank(world, kwargs, trainer_kwargs, batch, match):
    out = run_on_ranks(_fit_error, world, kwargs, trainer_kwargs, batch, timeout=120)
    assert out[0] is not None and match in out[0], out[0]
    assert all(o == out[0] for o in out)


class FailsOnLastStage(TinyGPT):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("user code failed on the last stage")
        return super().training_step(batch, batch_idx)


def _fail_mid_training():
    start = time.monotonic()
    try:
        fit_tiny_gpt(dict(pipeline_model_parallel_size=2, micro_batch_size=2, timeout=timedelta(seconds=8)),
                     module_cls=FailsOnLastStage)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)[:200], time.monotonic() - start
    return None


def test_a_rank_failing_mid_training_ends_the_run_within_the_timeout():
    first, last = run_on_ranks(_fail_mid_training, 2, timeout=90)
    assert last[1] == "user code failed on the last stage"
    assert first is not None and first[2] < 60, first     # the first stage gave up waiting, it did not hang


def _save_only(kwargs, folder):
    return fit_tiny_gpt(kwargs, max_steps=2, checkpoint_to=folder, dataset_size=16)["losses"]


def _resume_only(kwargs, folder):
    return fit_tiny_gpt(kwargs, max_steps=4, resume_from=folder, dataset_size=16)["losses"]


@pytest.mark.parametrize("world, kwargs", [(1, dict()), (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
                                           (2, dict()), (2, dict(tensor_model_parallel_size=2))])
def test_checkpoint_saved_at_tp2_pp2_resumes_at_another_layout(tmp_path, world, kwargs):
    from lightning_megatron.checkpoint import is_checkpoint

    ref_first, ref_resumed = run_on_ranks(_save_and_resume, 1, {}, str(tmp_path / "ref"), timeout=120)[0]
    folder = str(tmp_path / "tp2pp2.ckpt")
    saved = run_on_ranks(_save_only, 4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                             micro_batch_size=2), folder, timeout=180)
    assert saved[0] == pytest.approx(ref_first, rel=1e-5) and is_checkpoint(folder)
    for resumed in run_on_ranks(_resume_only, world, kwargs, folder, timeout=180):
        assert resumed == pytest.approx(ref_resumed, rel=1e-5)


def _model_checkpoint(folder):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=2, monitor="train_loss",
                               save_last=True)
    fit_tiny_gpt(dict(tensor_model_parallel_size=2), max_steps=4,
                 trainer_kwargs=dict(enable_checkpointing=True, callbacks=[callback]))
    return sorted(os.listdir(folder)), callback.best_model_path


def test_model_checkpoint_keeps_top_k_sharded_folders(tmp_path):
    from lightning_megatron.checkpoint import is_checkpoint

    names, best = run_on_ranks(_model_checkpoint, 2, str(tmp_path / "ckpts"), timeout=180)[0]
    assert "last.ckpt" in names and len(names) == 3, names          # two best + last, older ones removed
    assert all(is_checkpoint(str(tmp_path / "ckpts" / n)) for n in names)
    assert not any(n.endswith(".incomplete") for n in names)
    assert os.path.basename(best) in names


def _interrupted(kwargs, folder):
    """Uninterrupted 3 epochs saving every epoch; then resume from the end of epoch 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    world = os.environ["WORLD_SIZE"]
    every_epoch = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    straight = fit_tiny_gpt(kwargs, max_steps=6, dataset_size=16, module_cls=AdamGPT,
                            trainer_kwargs=dict(enable_checkpointing=True, callbacks=[every_epoch]))
    os.environ["WORLD_SIZE"] = world
    resumed = fit_tiny_gpt(kwargs, max_steps=6, dataset_size=16, module_cls=AdamGPT,
                           resume_from=os.path.join(folder, "epoch=0.ckpt"))
    return straight["losses"], resumed["losses"]


@pytest.mark.parametrize("world, kwargs", [(4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                                    micro_batch_size=2)),
                                           (4, dict(tensor_model_parallel_size=2))])
def test_interrupted_adamw_run_resumes_like_one_process(tmp_path, world, kwargs):
    """AdamW state (moments, step counts) resumes under TP2xPP2 and DP2xTP2 exactly as in one process.

    Lightning itself replays one batch when resuming from an end-of-epoch checkpoint (a plain
    single-device LightningModule does the same), so the reference is one process's resumed run.
    """
    ref_straight, ref_resumed = run_on_ranks(_interrupted, 1, {}, str(tmp_path / "ref"), timeout=120)[0]
    for straight, resumed in run_on_ranks(_interrupted, world, kwargs, str(tmp_path / "ckpts"), timeout=240):
        assert straight == pytest.approx(ref_straight, rel=1e-5)
        assert resumed[0] == straight[2]                            # the saved state, bit for bit
        assert resumed == pytest.approx(ref_resumed, rel=1e-5)


@pytest.mark.parametrize("world, kwargs", [(4, dict(tensor_model_parallel_size=2)), (2, dict()),
                                           (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
                                           (2, dict(context_parallel_size=2)),
                                           (4, dict(context_parallel_size=2, tensor_model_parallel_size=2))])
def test_predict_returns_outputs_on_rank0_in_dataset_order(world, kwargs):
    from helpers.strategy_utils import predict_tiny_gpt

    ref = run_on_ranks(predict_tiny_gpt, 1, dict(), timeout=120)[0]
    out = run_on_ranks(predict_tiny_gpt, world, kwargs, timeout=180)[0]
    assert ref.shape == (10, 8) and torch.equal(out, ref)


def _stop_and_resume(kwargs, folder):
    """Uninterrupted 8 steps (4 per epoch) checkpointing every step; resume from steps 2 and 5."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    world = os.environ["WORLD_SIZE"]
    every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    straight = fit_tiny_gpt(kwargs, max_steps=8, dataset_size=32, module_cls=AdamGPT,
                            trainer_kwargs=dict(enable_checkpointing=True, callbacks=[every_step]))["losses"]
    resumed = {}
    for step in (2, 5):
        os.environ["WORLD_SIZE"] = world
        resumed[step] = fit_tiny_gpt(kwargs, max_steps=8, dataset_size=32, module_cls=AdamGPT,
                                     resume_from=os.path.join(folder, f"step={step}.ckpt"))["losses"]
    return straight, resumed


@pytest.mark.parametrize("world, kwargs", [(4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                                    micro_batch_size=2)),
                                           (4, dict(tensor_model_parallel_size=2))])
def test_stop_at_step_k_and_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path, world, kwargs):
    for straight, resumed in run_on_ranks(_stop_and_resume, world, kwargs, str(tmp_path / "ckpts"), timeout=300):
        assert len(straight) == 8
        for step, losses in resumed.items():   # mid-epoch (2) and mid second epoch (5)
            assert losses == straight[step:], step


def _stop_and_resume_with_dropout(kwargs, folder, step):
    """Uninterrupted 8 steps with dropout 0.1, checkpointing every step; then resume from ``step``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    world = os.environ["WORLD_SIZE"]
    every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    straight = fit_tiny_gpt(kwargs, max_steps=8, dataset_size=32, module_cls=AdamGPT,
                            module_kwargs=dict(dropout=0.1),
                            trainer_kwargs=dict(enable_checkpointing=True, callbacks=[every_step]))["losses"]
    os.environ["WORLD_SIZE"] = world
    resumed = fit_tiny_gpt(kwargs, max_steps=8, dataset_size=32, module_cls=AdamGPT, module_kwargs=dict(dropout=0.1),
                           resume_from=os.path.join(folder, f"step={step}.ckpt"))["losses"]
    return straight, resumed


@pytest.mark.parametrize("world, kwargs, step", [
    (1, dict(), 3),
    (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2), 3),
    (2, dict(tensor_model_parallel_size=2), 5),   # in the second epoch
])
def test_resume_with_dropout_draws_the_same_masks(tmp_path, world, kwargs, step):
    """Dropout masks after a resume are those of the uninterrupted run: the RNG state restored from
    the checkpoint is not shifted by building the DataLoader iterator of the resumed epoch."""
    for straight, resumed in run_on_ranks(_stop_and_resume_with_dropout, world, kwargs, str(tmp_path / "ckpts"),
                                          step, timeout=300):
        assert len(straight) == 8
        assert resumed == straight[step:]


def _resume_across_compile(kwargs, folder, step, saved_compiled):
    """8 steps with dropout, layers compiled (traced by dynamo and AOTAutograd, run by the eager backend: eager's
    numbers) or not, checkpointing every step; then resume from ``step`` the other way."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    traced = dict(compile_layers={"backend": "aot_eager"})
    saving, resuming = (dict(kwargs, **traced), kwargs) if saved_compiled else (kwargs, dict(kwargs, **traced))
    world = os.environ["WORLD_SIZE"]
    every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    straight = fit_tiny_gpt(saving, max_steps=8, dataset_size=32, module_cls=AdamGPT, module_kwargs=dict(dropout=0.1),
                            trainer_kwargs=dict(enable_checkpointing=True, callbacks=[every_step]))["losses"]
    os.environ["WORLD_SIZE"] = world
    resumed = fit_tiny_gpt(resuming, max_steps=8, dataset_size=32, module_cls=AdamGPT,
                           module_kwargs=dict(dropout=0.1), resume_from=os.path.join(folder, f"step={step}.ckpt"))
    return straight, resumed["losses"]


@pytest.mark.parametrize("saved_compiled", [True, False])
def test_a_run_saved_with_compiled_layers_resumes_without_them_and_the_reverse(tmp_path, saved_compiled):
    """Compiled layers leave the checkpoint as eager ones write it (no ``_orig_mod``, the same RNG states): the
    resumed run continues the saved one exactly, with dropout on, at tp2."""
    for straight, resumed in run_on_ranks(_resume_across_compile, 2, dict(tensor_model_parallel_size=2),
                                          str(tmp_path / "ckpts"), 3, saved_compiled, timeout=300):
        assert len(straight) == 8
        assert resumed == straight[3:]


def test_sequence_parallel_without_tensor_parallelism_warns_and_is_off():
    from lightning_megatron import MegatronStrategy

    with pytest.warns(UserWarning, match="sequence_parallel=True does nothing with tensor_model_parallel_size=1"):
        strategy = MegatronStrategy(sequence_parallel=True)
    assert strategy.parallel.sequence_parallel is False
    assert MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True).parallel.sequence_parallel is True


class _LinearModule(L.LightningModule):
    """A plain ``nn.Linear`` module that logs with ``sync_dist=True`` in validation and test, and a torchmetrics
    object (it syncs over the data-parallel group the strategy gave it: each run's, not a destroyed one)."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.layer = torch.nn.Linear(4, 1)
        self.mae = torchmetrics.MeanAbsoluteError()

    def _loss(self, batch, name):
        x, y = batch
        self.mae(self.layer(x), y)
        self.log(f"{name}_mae", self.mae)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch, "val"), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch, "test"), sync_dist=True)


def _repeat_validate_and_test(strategy):
    """validate twice, then test twice, on one Trainer; every run's logged metrics."""
    from torch.utils.data import TensorDataset

    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    loader = DataLoader(data, batch_size=8 // world)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    module = _LinearModule()
    runs = [trainer.validate(module, loader, verbose=False), trainer.validate(module, loader, verbose=False),
            trainer.test(module, loader, verbose=False), trainer.test(module, loader, verbose=False)]
    return [{k: float(v) for k, v in run[0].items()} for run in runs]


@pytest.mark.parametrize("world", [1, 2])
def test_validate_and_test_twice_on_one_trainer(world):
    """Issue 18 item 1: the second validate/test on one Trainer logged with other arguments and failed."""
    ref = run_on_ranks(_repeat_validate_and_test, 1, "auto", timeout=120)[0]
    for runs in run_on_ranks(_repeat_validate_and_test, world, "megatron", timeout=180):
        assert len(runs) == 4
        for run, expected in zip(runs, ref):
            assert run.keys() == expected.keys()
            for k in expected:
                assert run[k] == pytest.approx(expected[k], rel=1e-6)


def _built_with_sequence_parallel(kwargs):
    from helpers.strategy_utils import TinyGPT

    seen = {}

    class Probe(TinyGPT):
        def configure_model(self):
            super().configure_model()
            seen["sp"] = [chunk.config.sequence_parallel for chunk in self.model.chunks]

    fit_tiny_gpt(kwargs, max_steps=1, module_cls=Probe)
    return seen["sp"]


def test_models_built_in_configure_model_follow_the_strategys_sequence_parallel():
    on = run_on_ranks(_built_with_sequence_parallel, 2, dict(tensor_model_parallel_size=2, sequence_parallel=True),
                      timeout=120)
    off = run_on_ranks(_built_with_sequence_parallel, 2, dict(tensor_model_parallel_size=2), timeout=120)
    assert on == [[True], [True]] and off == [[False], [False]]


class _Rebuilds(TinyGPT):
    """The README's old ``configure_model``: builds a new model at every call."""

    def configure_model(self):
        if hasattr(self, "model"):
            del self.model
        super().configure_model()


def _validate_after_fit(kwargs, rebuild):
    from helpers.strategy_utils import TokenData

    world = int(os.environ["WORLD_SIZE"])
    batch = 8 // (world // kwargs.get("pipeline_model_parallel_size", 1))
    L.seed_everything(0, verbose=False)
    module = (_Rebuilds if rebuild else TinyGPT)()
    trainer = L.Trainer(strategy=MegatronStrategy(**kwargs), accelerator="cpu", devices=world, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        max_epochs=1, limit_train_batches=4, num_sanity_val_steps=0)
    val = DataLoader(TokenData(n=16, seed=3), batch_size=batch)
    trainer.fit(module, DataLoader(TokenData(n=64), batch_size=batch), val)
    after_fit = float(trainer.callback_metrics["val_loss"])
    try:
        again = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    except RuntimeError as err:
        return str(err)
    return after_fit, float(again)


@pytest.mark.parametrize("world, kwargs", [(1, dict()), (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2))],
                         ids=["one", "pp2"])
def test_validate_after_fit_evaluates_the_trained_model_and_a_rebuilding_configure_model_is_refused(world, kwargs):
    for after_fit, again in run_on_ranks(_validate_after_fit, world, kwargs, False, timeout=180):
        assert again == pytest.approx(after_fit, rel=1e-6)
    out = run_on_ranks(_validate_after_fit, world, kwargs, True, timeout=180)
    assert all(o == out[0] for o in out) and "configure_model built new parameters" in out[0], out


def _predict_structured(kwargs, kind):
    """predict_step returning a dict with a nested tuple of tensors (``kind="nested"``) or per-sample strings."""
    from helpers.strategy_utils import PredictingGPT, TokenData

    class Structured(PredictingGPT):
        def predict_step(self, batch, batch_idx):
            ids = super().predict_step(batch, batch_idx)
            if kind == "nested":
                return {"ids": ids, "pair": (ids[:, 0], ids + 1)}
            return [f"sample {int(i)}" for i in ids[:, 0]]

    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=MegatronStrategy(**kwargs), accelerator="cpu", devices=world, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.predict(Structured(), DataLoader(TokenData(n=10, seed=2), batch_size=4 // world))
    warned = [str(w.message) for w in caught if "predict_step returned" in str(w.message)]
    if kind != "nested":
        return sum(out, []), warned
    return {"ids": torch.cat([o["ids"] for o in out]), "first": torch.cat([o["pair"][0] for o in out]),
            "next": torch.cat([o["pair"][1] for o in out])}, warned


def test_structured_predictions_are_put_in_dataset_order_and_others_warn():
    ref, _ = run_on_ranks(_predict_structured, 1, dict(), "nested", timeout=120)[0]
    assert ref["ids"].shape == (10, 8)
    for out, warned in run_on_ranks(_predict_structured, 2, dict(), "nested", timeout=180):
        assert warned == [] and all(torch.equal(out[k], ref[k]) for k in ref)
    strings = run_on_ranks(_predict_structured, 2, dict(), "strings", timeout=180)
    assert len(strings[0][0]) == 5 and len(strings[0][1]) == 1   # rank 0's own 5 of the 10 samples, and it says so


def _ragged_warnings(kwargs, size):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_tiny_gpt(kwargs, max_steps=1, dataset_size=size)
    return [str(w.message) for w in caught if "last training batch" in str(w.message)]


@pytest.mark.parametrize("world, kwargs", [(1, dict(micro_batch_size=2)),
                                           (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2))])
def test_a_last_training_batch_that_micro_batches_cannot_split_is_announced_at_setup(world, kwargs):
    """29 samples in batches of 8 end in a batch of 5, whose step would be refused after the epoch's others."""
    warned = run_on_ranks(_ragged_warnings, world, kwargs, 29, timeout=120)[0]
    assert len(warned) == 1 and "holds 5 samples" in warned[0] and "micro_batch_size=2" in warned[0], warned
    assert run_on_ranks(_ragged_warnings, world, kwargs, 30, timeout=120)[0] == []   # a last batch of 6 splits


@pytest.mark.parametrize("scope", ["layer", "block"])
def test_partial_graphs_with_dropout_train_like_eager_through_the_trainer(scope):
    """Dropout's masks inside partial graphs (the capture's warm-up and replays drawing from the strategy's RNG
    tracker) are eager training's: the same updates at one process, several micro-batches a step."""
    module_kwargs = dict(dropout=0.1)
    eager = run_on_ranks(fit_and_record, 1, dict(micro_batch_size=2), module_kwargs, max_steps=4, timeout=120)[0]
    graphed = run_on_ranks(fit_and_record, 1, dict(micro_batch_size=2, cuda_graph="partial", cuda_graph_scope=scope,
                                                   cuda_graph_backend="eager"), module_kwargs, max_steps=4,
                           timeout=120)[0]
    assert_same_updates(graphed["params"], eager["params"])
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-6)
