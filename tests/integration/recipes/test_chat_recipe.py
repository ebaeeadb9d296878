"""The chat fine-tuning recipe against transformers: the loss of packed rows is the per-token mean of
``LlamaForCausalLM``'s losses on the conversations one at a time (assistant tokens only, labels from transformers'
own ``{% generation %}`` mask), and ``examples/chat_tiny.yaml`` trained at two pipeline stages exports a folder whose
validation loss under transformers equals the one the recipe printed for its trained model."""

import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from torch.utils.data import default_collate

from lightning_megatron.recipes.chat import ChatData, ChatFinetuning
from lightning_megatron.recipes.chat.sample import CHAT_TEMPLATE
from helpers.chat_utils import hf_loss_sum_and_count, reference_examples, write_sample
from helpers.paths import ROOT


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return write_sample(tmp_path_factory.mktemp("chat"))


def _hf(folder):
    return transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _sharpened(model_dir, out):
    """The model with sharp attention (query and key weights 20x) that weighs in the output (value and output
    projections 10x): attending across conversations then moves the loss by far more than float32 rounding (at
    the sample's 0.02 init it moves it by 2e-5 of itself)."""
    model = _hf(model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20.0)
            elif name.endswith(("v_proj.weight", "o_proj.weight")):
                param.mul_(10.0)
    model.save_pretrained(str(out))
    return out


def test_packed_loss_equals_transformers_one_conversation_at_a_time(sample, one_rank, tmp_path):
    """Packed rows of several conversations each: with attention inside each conversation and labels on assistant
    tokens only, their summed loss and token count are transformers' over the conversations one by one (float32).
    Without the document mask, or with labels on user tokens, they are not. (Positions restarting per conversation
    do not change the loss under RoPE with the document mask: attention sees relative positions only.)"""
    valid = str(sample / "valid.jsonl")
    model_dir = _sharpened(sample / "model", tmp_path / "sharp")
    data = ChatData([valid], str(sample / "model"), seq_length=128, batch_size=1)
    data.setup("fit")
    rows = data._sets["train"]
    assert len(rows) < 16   # several conversations share a row
    batch = default_collate([rows[i] for i in range(len(rows))])
    module = ChatFinetuning(pretrained=str(model_dir))
    module.configure_model()
    with torch.no_grad():
        losses = module(batch)
    counted = batch["labels"] != -100
    expected_sum, expected_count = hf_loss_sum_and_count(_hf(model_dir), reference_examples(sample / "model", valid))
    assert int(counted.sum()) == expected_count
    assert float((losses * counted).sum()) == pytest.approx(expected_sum, rel=1e-5)


def test_cli_fine_tunes_at_two_pipeline_stages_and_exports_what_it_trained(sample, tmp_path):
    export = tmp_path / "export"
    cmd = [sys.executable, "-m", "lightning_megatron", "fit", "--config", os.path.join(ROOT, "examples", "chat_tiny.yaml"),
           "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.devices", "2",
           "--trainer.strategy.pipeline_model_parallel_size", "2", "--trainer.strategy.micro_batch_size", "2",
           "--model.pretrained", str(sample / "model"), "--model.export_dir", str(export),
           "--data.train_files", f"[{sample / 'train.jsonl'}]", "--data.valid_files", f"[{sample / 'valid.jsonl'}]",
           "--data.tokenizer", str(sample / "model"), "--data.sample", "null"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "chat data (train" in done.stderr and "574 assistant tokens trained" in done.stderr, done.stderr[-3000:]
    final = dict(re.findall(r"(\S+)=([-\d.e]+)", re.search(r"final (.*)", done.stdout).group(1)))

    valid = reference_examples(export, sample / "valid.jsonl")   # the exported tokenizer, marked for transformers
    total, count = hf_loss_sum_and_count(_hf(export), valid)
    assert float(final["val_loss"]) == pytest.approx(total / count, rel=2e-5)
    before, _ = hf_loss_sum_and_count(_hf(sample / "model"), valid)
    assert total / count < before / count - 0.5, (total / count, before / count)   # it trained
    assert transformers.AutoTokenizer.from_pretrained(str(export)).chat_template == CHAT_TEMPLATE
