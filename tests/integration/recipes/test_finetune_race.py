"""BertForRACE under Trainer(strategy="megatron") on one CPU rank, on a small RACE tree written here:
it learns the questions (dev accuracy far above chance, the loss well below ln 4), and reports middle, high
and all, where 'all' is the question-weighted mean of the two."""

import contextlib
import io
import json
import math
import random

import lightning as L
import pytest

from lightning_megatron.recipes.data import RaceDataModule, SAMPLE_DIR
from lightning_megatron.recipes.finetune import BertForRACE, BertShape
from lightning_megatron.testing import run_on_ranks

PLACES = ["market", "park", "harbor", "station"]
THINGS = ["map", "key", "book", "lamp", "sword", "camera", "guitar", "ticket"]   # single tokens of the sample vocab


def write_race(root, questions_per_level=(6, 10), shuffle_train_answers=False):
    """Each question asks where the baker went; exactly one option is a place, at a random position (so a
    model learns it in a few steps, and a model that did not learn is right about a quarter of the time).
    Dev holds other questions than train. ``shuffle_train_answers``: random training answers (unlearnable)."""
    for split, seed in (("train", 0), ("dev", 1)):
        rng = random.Random(seed)
        for level, count in zip(("middle", "high"), questions_per_level):
            folder = root / split / level
            folder.mkdir(parents=True)
            for i in range(count):
                answer = rng.randrange(4)
                others = rng.sample(THINGS, 3)
                options = others[:answer] + [rng.choice(PLACES)] + others[answer:]
                if shuffle_train_answers and split == "train":
                    answer = rng.randrange(4)
                question = "the baker went to the _ ." if level == "high" else "the baker went to the"
                (folder / f"{i}.txt").write_text(json.dumps({
                    "id": f"{level}{i}.txt", "article": "the baker was very busy .",
                    "questions": [question], "options": [options], "answers": ["ABCD"[answer]]}))


def fit_race(data_dir, epochs, lr=1e-2):
    L.seed_everything(0, verbose=False)
    module = BertForRACE(random_init=BertShape(num_layers=1, hidden_size=32, num_attention_heads=2), lr=lr)
    data = RaceDataModule(data_dir, tokenizer=SAMPLE_DIR, batch_size=4, eval_batch_size=4, max_seq_length=32,
                          max_qa_length=16)
    losses = []

    class RecordLoss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, *args):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(strategy="megatron", accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, check_val_every_n_epoch=epochs, callbacks=[RecordLoss()])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(module, data)
    return {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "printed": printed.getvalue(),
            "steps": trainer.global_step, "losses": losses}


def test_race_trains_and_reports_middle_high_all(tmp_path):
    write_race(tmp_path)
    out = run_on_ranks(fit_race, 1, str(tmp_path), 5, init_process_group=False, timeout=120)[0]
    metrics = out["metrics"]
    assert out["steps"] == 20   # 5 epochs of 16 questions, 4 a batch
    middle, high, everything = metrics["val/acc_middle"], metrics["val/acc_high"], metrics["val/acc_all"]
    assert everything == pytest.approx((6 * middle + 10 * high) / 16, abs=1e-6)
    assert "dev accuracy (epoch 4, step 20): middle" in out["printed"] and "all " in out["printed"]
    # it learned: chance is 1/4 (here lr=0 scores 0.375 in all, 0.5 middle; random training answers 0.06)
    assert middle >= 0.8 and high >= 0.8, metrics
    losses = out["losses"]
    assert losses[0] == pytest.approx(math.log(4), abs=0.02)   # four near-equal scores before training
    assert sum(losses[-4:]) / 4 < math.log(4) - 0.5, losses    # the last epoch: ~0.5 nats lower at least
