"""The MNLI recipe under TP=2 and DP=2 on 2 CPU ranks gives the single-rank results (dropout off)."""

import os

import lightning as L
import pytest

from lightning_megatron import MegatronStrategy
from lightning_megatron.recipes.data import MNLIDataModule
from lightning_megatron.recipes.finetune import BertForMNLI, BertShape
from lightning_megatron.testing import run_on_ranks

TINY = BertShape(num_layers=2, hidden_size=128, num_attention_heads=4)


def fit(tp):
    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    module = BertForMNLI(pretrained="minilm-if-installed", random_init=TINY, lr=1e-4, warmup_fraction=0.0,
                         config_overrides=dict(hidden_dropout=0.0, attention_dropout=0.0))
    trainer = L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=tp), accelerator="cpu", devices=world,
                        max_steps=4, val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, MNLIDataModule(batch_size=16 // (world // tp), eval_batch_size=16 // (world // tp)))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("tp", [2, 1])
def test_mnli_recipe_matches_single_rank(tp):
    ref = run_on_ranks(fit, 1, 1, init_process_group=False, timeout=240)[0]
    out = run_on_ranks(fit, 2, tp, init_process_group=False, timeout=240)
    for metrics in out:
        assert metrics["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-4)
        for name in ("val/acc_matched", "val/acc_mismatched"):
            assert metrics[name] == pytest.approx(ref[name], abs=1e-6), name
