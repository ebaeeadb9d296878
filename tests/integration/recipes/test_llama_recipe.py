"""The Llama pre-training recipe from nothing: sample corpus, tokenizer, token files, falling loss, tokens/s."""

import re
import subprocess
import sys
from pathlib import Path

from helpers import paths

ROOT = Path(paths.ROOT)


def test_llama_tiny_recipe_learns_the_sample_corpus(tmp_path):
    data = tmp_path / "corpus"
    run = subprocess.run(
        [sys.executable, "-m", "lightning_megatron", "fit", "--config", str(ROOT / "examples" / "llama_tiny.yaml"),
         "--trainer.max_steps", "40", "--trainer.val_check_interval", "40", "--trainer.log_every_n_steps", "10",
         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
         "--data.sample_corpus", str(data), "--data.train_prefixes", f"[{data}/train]",
         "--data.valid_prefixes", f"[{data}/valid]"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    final = dict(re.findall(r"(\S+)=([-\d.e]+)", next(l for l in run.stdout.splitlines() if l.startswith("final "))))
    # a uniform guess over the 512-id vocabulary is ln(512) = 6.24 nats; the generated stories are far more regular
    assert float(final["val_loss"]) < 3.5, final
    assert float(final["train_loss"]) < 3.5, final
    assert float(final["throughput/tokens_per_sec"]) > 0
    assert (data / "train.bin").exists() and (data / "tokenizer" / "tokenizer.json").exists()
