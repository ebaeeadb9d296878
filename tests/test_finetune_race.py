"""BertForRACE under Trainer(strategy="megatron") on one CPU rank, on a small RACE tree written here:
it trains, and reports middle, high and all, where 'all' is the question-weighted mean of the two."""

import contextlib
import io
import json

import lightning as L
import pytest

from lightning_megatron.data import RaceDataModule, SAMPLE_DIR
from lightning_megatron.finetune import BertForRACE, BertShape
from lightning_megatron.testing import run_on_ranks

COLORS = ["red", "blue", "green", "black"]


def write_race(root, questions_per_level=(6, 10)):
    """Each passage names a colour; the question asks for it (a cloze with '_' for high)."""
    for split in ("train", "dev"):
        for level, count in zip(("middle", "high"), questions_per_level):
            folder = root / split / level
            folder.mkdir(parents=True)
            for i in range(count):
                answer = (i * 3 + len(level)) % 4
                question = "the baker sold a _ map ." if level == "high" else "what did the baker sell ?"
                (folder / f"{i}.txt").write_text(json.dumps({
                    "id": f"{level}{i}.txt", "article": f"the baker sold a {COLORS[answer]} map in the market .",
                    "questions": [question], "options": [COLORS], "answers": ["ABCD"[answer]]}))


def fit_race(data_dir, max_steps):
    L.seed_everything(0, verbose=False)
    module = BertForRACE(random_init=BertShape(num_layers=1, hidden_size=32, num_attention_heads=2), lr=1e-3)
    data = RaceDataModule(data_dir, tokenizer=SAMPLE_DIR, batch_size=4, eval_batch_size=4, max_seq_length=32,
                          max_qa_length=16)
    trainer = L.Trainer(strategy="megatron", accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, val_check_interval=max_steps)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(module, data)
    return {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "printed": printed.getvalue(),
            "steps": trainer.global_step}


def test_race_trains_and_reports_middle_high_all(tmp_path):
    write_race(tmp_path)
    out = run_on_ranks(fit_race, 1, str(tmp_path), 4, init_process_group=False, timeout=120)[0]
    metrics = out["metrics"]
    assert out["steps"] == 4
    middle, high, everything = metrics["val/acc_middle"], metrics["val/acc_high"], metrics["val/acc_all"]
    assert everything == pytest.approx((6 * middle + 10 * high) / 16, abs=1e-6)
    assert "dev accuracy (epoch 0, step 4): middle" in out["printed"] and "all " in out["printed"]
    assert metrics["train/loss"] > 0
