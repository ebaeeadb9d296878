"""What ``self.log`` in a ``training_step`` gives when the strategy runs the step as micro-batches (and the
pipeline's last stage only), from the public API.

A probe found values computed from the batch logged as the mean over micro-batches whatever their
``reduce_fx`` (a token count of 34 logged as 8.5, its epoch sum 33.25 instead of 133), at one process with
``micro_batch_size`` too; and a value the strategy cannot log raised on the last stage only, leaving the
other stages waiting.
"""

import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import VOCAB, TinyGPT, fit_tiny_gpt


class CountingGPT(TinyGPT):
    """Logs sums, maxima and minima over the batch's samples, each with its own ``reduce_fx``."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        labels = batch["labels"]
        common = dict(on_step=True, on_epoch=True, sync_dist=True)
        self.log("low_tokens", (labels < VOCAB // 4).sum().float(), reduce_fx="sum", **common)
        self.log("max_id", labels.max().float(), reduce_fx="max", **common)
        self.log_dict({"min_id": labels.min().float()}, reduce_fx=torch.min, **common)
        return loss


def _logged(kwargs):
    return fit_tiny_gpt(kwargs, max_steps=4, dataset_size=32, module_cls=CountingGPT)["logged"]


@pytest.mark.parametrize("world, kwargs", [
    (1, dict(micro_batch_size=2)),
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2, virtual_pipeline_model_parallel_size=2)),
    (2, dict(micro_batch_size=1)),
], ids=["mbs2", "pp2", "pp2-vpp2", "dp2-mbs1"])
def test_logged_sums_maxima_and_minima_are_one_process_values(world, kwargs):
    ref = run_on_ranks(_logged, 1, dict(), timeout=120)[0]
    for name in ("low_tokens", "max_id", "min_id"):   # the data makes them differ between micro-batches
        assert f"{name}_step" in ref and f"{name}_epoch" in ref
    assert ref["low_tokens_step"] > 8 and ref["low_tokens_epoch"] > ref["low_tokens_step"]
    for logged in run_on_ranks(_logged, world, kwargs, timeout=180):
        assert logged == pytest.approx(ref, rel=1e-6), logged


class LogsAVector(TinyGPT):
    def training_step(self, batch, batch_idx):
        self.log("per_sample", batch["labels"].float().mean(dim=1))
        return super().training_step(batch, batch_idx)


def _vector_error(kwargs):
    try:
        fit_tiny_gpt(kwargs, max_steps=1, module_cls=LogsAVector)
    except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("world, kwargs", [(1, dict(micro_batch_size=2)),
                                           (4, dict(pipeline_model_parallel_size=4, micro_batch_size=2))],
                         ids=["mbs2", "pp4"])
def test_a_value_that_cannot_be_logged_is_raised_on_every_rank(world, kwargs):
    out = run_on_ranks(_vector_error, world, kwargs, timeout=120)
    assert out[0] is not None and out[0].startswith("ValueError: self.log('per_sample', ...) got a tensor of shape"), \
        out[0]
    assert all(o == out[0] for o in out), out   # the first stages, which never ran training_step, too


# --- torchmetrics objects: only the last stage runs the step; every stage's copy must hold its states -------

class MetricGPT(TinyGPT):
    """Metrics whose epoch value is not a mean of batch values (a macro average, a weighted mean, an AUROC over
    every sample: list states), one only updated (no batch value), one computed in an epoch-end hook."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import torchmetrics
        from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy

        self.macro = MulticlassAccuracy(num_classes=VOCAB, average="macro")
        self.weighted = torchmetrics.MeanMetric()
        self.updated_only = torchmetrics.MeanMetric()
        self.auroc = BinaryAUROC()
        self.epoch_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")

    def validation_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])[..., :VOCAB]
        labels = batch["labels"]
        preds = logits.argmax(-1)
        self.macro(preds, labels)
        self.log("val_macro", self.macro)
        self.weighted(labels.float().mean(dim=1), labels[:, 0].float() + 1)
        self.log("val_weighted", self.weighted)
        self.updated_only.update(labels.float())
        self.log("val_updated_only", self.updated_only)
        self.auroc(logits.softmax(-1)[..., 0].flatten(), (labels < VOCAB // 2).flatten().int())
        self.log("val_auroc", self.auroc)
        self.epoch_acc.update(preds, labels)

    def on_validation_epoch_end(self):
        self.log("val_epoch_acc", self.epoch_acc.compute(), sync_dist=True)
        self.epoch_acc.reset()


def _validated_thrice(kwargs, global_batch_size=8):
    """Validations on one Trainer, each on other data: a copy left with an earlier run's states would show."""
    import os

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronStrategy
    from helpers.strategy_utils import TokenData

    world = int(os.environ["WORLD_SIZE"])
    model_parallel = kwargs.get("pipeline_model_parallel_size", 1)
    batch = global_batch_size // (world // model_parallel)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=MegatronStrategy(**kwargs), accelerator="cpu", devices=world, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = MetricGPT()
    runs = [trainer.validate(module, DataLoader(TokenData(n=size, seed=seed), batch_size=batch), verbose=False)[0]
            for size, seed in ((24, 1), (8, 2), (8, 3))]   # the third: as many updates as the second
    return [{k: float(v) for k, v in run.items()} for run in runs]


@pytest.mark.parametrize("world, kwargs", [
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2, virtual_pipeline_model_parallel_size=2)),
    (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
], ids=["pp2", "pp2-vpp2", "pp2-dp2"])
def test_metric_objects_under_pipeline_parallelism_give_one_process_epoch_values(world, kwargs):
    ref = run_on_ranks(_validated_thrice, 1, dict(), timeout=120)[0]
    assert ref[0] != ref[1] != ref[2]
    for runs in run_on_ranks(_validated_thrice, world, kwargs, timeout=240):
        for run, expected in zip(runs, ref):
            assert run == pytest.approx(expected, rel=1e-5, abs=1e-7), (run, expected)


# --- what training_step returns besides the loss reaches on_train_batch_end ---------------------------------

class ReturnsMore(TinyGPT):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        labels = batch["labels"].float()
        return {"loss": loss, "mean_label": labels.mean(), "per_sample": labels.mean(dim=1), "tag": "kept"}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in outputs.items()})


def _outputs(kwargs):
    from helpers.strategy_utils import TokenData

    seen = {}

    class Keep(ReturnsMore):
        def on_train_end(self):
            seen["outputs"] = self.seen

    fit_tiny_gpt(kwargs, max_steps=3, module_cls=Keep, dataset=TokenData(n=64))
    return seen["outputs"]


@pytest.mark.parametrize("world, kwargs", [
    (1, dict(micro_batch_size=2)),
    (1, dict(micro_batch_size=2, cuda_graph="full", cuda_graph_backend="eager")),
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
    (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2, virtual_pipeline_model_parallel_size=2)),
], ids=["mbs2", "mbs2-full-graph", "pp2", "pp2-vpp2"])
def test_training_step_outputs_besides_the_loss_reach_on_train_batch_end(world, kwargs):
    ref = run_on_ranks(_outputs, 1, dict(), timeout=120)[0]
    assert set(ref[0]) == {"loss", "mean_label", "per_sample", "tag"} and len(ref[0]["per_sample"]) == 8
    for seen in run_on_ranks(_outputs, world, kwargs, timeout=180):   # every stage, the first ones too
        assert len(seen) == len(ref)
        for got, expected in zip(seen, ref):
            assert got.keys() == expected.keys()
            assert got["tag"] == "kept"
            for key in ("loss", "mean_label", "per_sample"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5), key


# --- context parallelism: each rank holds a share of every sequence ---------------------------------------

class WithClassProbs(torch.utils.data.Dataset):
    """TokenData plus a per-sample vector (not a sequence: context parallelism must not cut it)."""

    def __init__(self, n=32):
        from helpers.strategy_utils import TokenData

        self.tokens = TokenData(n=n)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return dict(self.tokens[i], class_probs=torch.arange(4.0) + i)


class ShareLoggingGPT(TinyGPT):
    """Logs without ``sync_dist``: values every tp/cp/pp peer must agree on (one process's, data-parallel
    rank by rank as under DDP)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        labels = batch["labels"]
        self.log("low_tokens_local", (labels < VOCAB // 4).sum().float(), reduce_fx="sum")
        self.log("max_id_local", labels.max().float(), reduce_fx="max")
        self.log("first_prob", batch["class_probs"][:, 0].mean())
        self.log("loss_local", loss)
        return loss


def _share_logged(kwargs):
    return fit_tiny_gpt(kwargs, max_steps=3, module_cls=ShareLoggingGPT, dataset=WithClassProbs())["logged"]


@pytest.mark.parametrize("world, kwargs", [(2, dict(context_parallel_size=2)),
                                           (4, dict(context_parallel_size=2, tensor_model_parallel_size=2)),
                                           (2, dict(context_parallel_size=2, micro_batch_size=2))],
                         ids=["cp2", "cp2-tp2", "cp2-mbs2"])
def test_values_logged_from_shares_of_the_sequences_are_one_process_values(world, kwargs):
    ref = run_on_ranks(_share_logged, 1, dict(), timeout=120)[0]
    for logged in run_on_ranks(_share_logged, world, kwargs, timeout=180):
        assert logged == pytest.approx(ref, rel=1e-5), (logged, ref)
