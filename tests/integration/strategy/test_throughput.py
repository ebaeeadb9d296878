"""Model FLOPs against a brute-force count, and MegatronThroughputMonitor's numbers at 1 and 2 ranks and from
a recipe YAML: samples and tokens counted over the data-parallel ranks once, FLOPs of the whole model once."""

import csv
import dataclasses
import glob
import logging
import os
import re
import subprocess
import sys

import lightning as L
import pytest
import torch

from lightning_megatron import MegatronStrategy
from lightning_megatron.adapter.callbacks import PREFIX, MegatronThroughputMonitor, batch_counts, peak_flops_per_device
from lightning_megatron.transformer.flops import (
    forward_flops_per_sequence, linear_training_flops, training_flops_per_sequence, training_flops_per_token,
)
from lightning_megatron.moe import MoEConfig
from lightning_megatron.recipes.pretrain import GPTPretraining, PatternTokens
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig

from helpers.paths import ROOT

VOCAB, SEQ, GLOBAL_BATCH = 64, 32, 8
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4)


def cfg(**overrides):
    return TransformerConfig(**{**GPT, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})


# -- the FLOP formula -----------------------------------------------------------------------------------

def _counted(loss_fn):
    """Matmul FLOPs of ``loss_fn().backward()`` as torch counts them (math attention: its bmm's are counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        loss_fn().backward()
    return counter.get_total_flops()


# grouped-query attention and a head size of its own, where TransformerConfig has them (issue #18, in progress)
HAS_GQA = "num_query_groups" in {f.name for f in dataclasses.fields(TransformerConfig)}


def _count_models():
    """(name, counted by torch, formula) for GPT variants and the recipes' own LightningModules."""
    from lightning_megatron.recipes.finetune import BertForMNLI, BertForRACE, BertShape
    from lightning_megatron.models import GPTModel
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    ParallelState(ParallelLayout(1)).activate()
    torch.manual_seed(0)
    b, s, vocab = 2, 16, 128   # a vocabulary of 128 rows is not padded: the logits GEMM is the formula's
    moe = dict(hidden_size=32, ffn_hidden_size=24, num_experts=4, topk=2)
    one = dict(num_layers=1)   # op by op counting is slow: one layer where the layer count adds nothing
    gqa = [("gqa_kv_channels", cfg(**one, num_query_groups=2, kv_channels=12)),
           ("llama_like", cfg(**one, num_query_groups=2, activation="swiglu", ffn_hidden_size=48, add_bias_linear=False,
                              normalization="RMSNorm", position_embedding_type="rope"))] if HAS_GQA else []
    out = []
    for name, config in gqa + [
        ("gelu", cfg(**one)),
        ("swiglu", cfg(**one, activation="swiglu", ffn_hidden_size=48)),
        ("moe_every_2nd_shared_expert", cfg(num_layers=3, moe_layer_freq=2,
                                            moe=MoEConfig(**moe, shared_expert_ffn_hidden_size=40))),
        ("moe_gelu_experts", cfg(**one, moe=MoEConfig(**moe, activation="gelu"))),
    ]:
        model = GPTModel(config, vocab, s)
        ids = torch.randint(0, vocab, (b, s))
        # the math kernel computes the whole score matrix: compare with the non-causal count
        out.append((f"gpt_{name}", _counted(lambda: model(ids, labels=ids).mean()),
                    b * training_flops_per_sequence(config, s, vocab, causal=False)))
    shape = BertShape(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=vocab)
    for module, ids in [(BertForMNLI(random_init=shape), torch.randint(0, vocab, (b, s))),
                        (BertForRACE(random_init=shape), torch.randint(0, vocab, (b, 4, s)))]:
        module.configure_model()
        mask = torch.ones_like(ids)
        mask[..., -3:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
                 "labels": torch.randint(0, module.num_classes, (b,))}
        out.append((type(module).__name__, _counted(lambda: module._loss(module(batch), batch["labels"])),
                    module.training_flops(batch)))
    return out


def test_flops_match_torch_flop_counter():
    """Attention (QK^T, AV), gated MLPs, MoE (router + top-k experts + shared expert, every k-th layer), the
    logits GEMM and the BERT heads: exactly the matmul FLOPs torch counts in forward + backward."""
    rows = run_on_ranks(_count_models, 1, timeout=120)[0]
    assert len(rows) == 6 + 2 * HAS_GQA
    for name, counted, formula in rows:
        assert formula == counted, (name, formula, counted)


def test_flops_formula_terms():
    h, s, v, f = 32, 16, 64, 128
    full = forward_flops_per_sequence(cfg(), s, v, causal=False)
    # QKV + projection 8h^2, scores and AV 4sh per token and layer; MLP 4hf; logits 2hV
    assert full == s * (2 * (8 * h * h + 4 * s * h + 4 * h * f) + 2 * h * v)
    assert full - forward_flops_per_sequence(cfg(), s, v) == 2 * 2 * h * s * s   # causal: half the scores
    assert forward_flops_per_sequence(cfg(attn_mask_type="padding"), s) == full - s * 2 * h * v
    assert training_flops_per_sequence(cfg(), s, v) == 3 * forward_flops_per_sequence(cfg(), s, v)
    assert training_flops_per_token(cfg(), s, v) == training_flops_per_sequence(cfg(), s, v) / s
    # SwiGLU: three h x f GEMMs instead of two
    assert (forward_flops_per_sequence(cfg(activation="swiglu"), s) - forward_flops_per_sequence(cfg(), s)
            == 2 * s * 2 * h * f)
    # MoE on every layer: router 2hE + topk experts' MLP instead of the dense MLP
    moe = cfg(moe=MoEConfig(hidden_size=h, ffn_hidden_size=24, num_experts=8, topk=2, activation="gelu"))
    assert (forward_flops_per_sequence(moe, s) - forward_flops_per_sequence(cfg(), s)
            == 2 * s * (2 * h * 8 + 2 * 4 * h * 24 - 4 * h * f))
    assert linear_training_flops(3, 5, rows=7) == 6 * 3 * 5 * 7
    with pytest.raises(ValueError, match="seq_length"):
        forward_flops_per_sequence(cfg(), 0)
    with pytest.raises(ValueError, match="vocab_size"):
        forward_flops_per_sequence(cfg(), s, 0)


# -- the callback's arguments and helpers -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [(dict(window=0), "window"), (dict(window=-3), "window"),
                                          (dict(window=True), "window"), (dict(peak_flops=0), "peak_flops"),
                                          (dict(peak_flops=float("inf")), "peak_flops"),
                                          (dict(input_key=3), "input_key")])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"MegatronThroughputMonitor\({name}="):
        MegatronThroughputMonitor(**kwargs)


def test_batch_counts_and_peak_lookup():
    assert batch_counts({"input_ids": torch.zeros(4, 32, dtype=torch.long)}) == (4, 128)
    assert batch_counts({"input_ids": torch.zeros(2, 4, 16, dtype=torch.long)}) == (2, 128)   # RACE's choices
    assert batch_counts((torch.zeros(5, 3), torch.zeros(5))) == (5, None)   # features: samples only
    assert batch_counts({"x": [torch.zeros(6, 8, dtype=torch.long)]}, input_key="ids") == (6, 48)
    with pytest.raises(ValueError, match="input_key='input_ids'"):
        batch_counts({"text": ["a", "b"]})
    assert peak_flops_per_device(torch.device("cpu"), "bf16-mixed") is None


# -- the callback in a Trainer ------------------------------------------------------------------------------

class GPTWithoutFlops(GPTPretraining):
    training_flops = None   # a module that does not say its FLOPs


def fit_with_monitor(strategy_kwargs, accumulate=1, peak_flops=None, without_flops=False, max_steps=5):
    """Fit the GPT recipe's module with a 2-step window; the logged metrics, and Lightning's info messages."""
    world = int(os.environ["WORLD_SIZE"])
    model_parallel = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= strategy_kwargs.get(key, 1)
    per_rank = GLOBAL_BATCH // (world // model_parallel) // accumulate
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    L.seed_everything(0, verbose=False)
    module = (GPTWithoutFlops if without_flops else GPTPretraining)(vocab_size=VOCAB, seq_length=SEQ, **GPT)
    trainer = L.Trainer(strategy=MegatronStrategy(**strategy_kwargs), accelerator="cpu", devices=world,
                        max_steps=max_steps, accumulate_grad_batches=accumulate, log_every_n_steps=2,
                        callbacks=[MegatronThroughputMonitor(peak_flops=peak_flops)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(module, PatternTokens(vocab_size=VOCAB, seq_length=SEQ, batch_size=per_rank, train_size=256))
    metrics = {k[len(PREFIX):]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(PREFIX)}
    return {"metrics": metrics, "messages": messages}


def _check_counts(m, world):
    """One optimizer step read the global batch (all data-parallel ranks, all accumulated batches) and did
    the FLOPs of the whole model over it once; the per-device rate is that over the world size."""
    assert m["samples_per_sec"] * m["step_time_sec"] == pytest.approx(GLOBAL_BATCH, rel=1e-5)
    assert m["tokens_per_sec"] == pytest.approx(m["samples_per_sec"] * SEQ, rel=1e-5)
    step_flops = GLOBAL_BATCH * training_flops_per_sequence(cfg(), SEQ, VOCAB)
    assert m["tflops_per_device"] * 1e12 * world * m["step_time_sec"] == pytest.approx(step_flops, rel=1e-4)


def test_one_process_with_accumulation_and_mfu():
    out = run_on_ranks(fit_with_monitor, 1, {}, accumulate=2, peak_flops=1e11, timeout=120)[0]
    m = out["metrics"]
    assert set(m) == {"samples_per_sec", "tokens_per_sec", "step_time_sec", "tflops_per_device", "mfu"}   # CPU: no memory
    _check_counts(m, world=1)
    assert m["mfu"] == pytest.approx(m["tflops_per_device"] * 1e12 / 1e11, rel=1e-5)
    assert not any("training_flops" in msg for msg in out["messages"])


def test_module_without_flops_logs_rates_only_and_says_so():
    out = run_on_ranks(fit_with_monitor, 1, {}, without_flops=True, max_steps=3, timeout=120)[0]
    assert set(out["metrics"]) == {"samples_per_sec", "tokens_per_sec", "step_time_sec"}, out["metrics"]
    assert sum("has no training_flops(batch)" in msg for msg in out["messages"]) == 1, out["messages"]


@pytest.mark.parametrize("layout", [dict(), dict(tensor_model_parallel_size=2),
                                    dict(pipeline_model_parallel_size=2, micro_batch_size=2)],
                         ids=["dp2", "tp2", "pp2"])
def test_two_ranks_count_the_global_batch_and_the_model_once(layout):
    out = run_on_ranks(fit_with_monitor, 2, layout, timeout=180)
    assert out[0]["metrics"] == out[1]["metrics"]   # reduced over the ranks: every rank logs the same values
    _check_counts(out[0]["metrics"], world=2)


# -- from a recipe YAML ------------------------------------------------------------------------------------------

def test_recipe_yaml_logs_throughput(tmp_path):
    cmd = [sys.executable, "-m", "lightning_megatron", "fit", "--config", os.path.join(ROOT, "examples", "gpt_tiny.yaml"),
           "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2", "--trainer.val_check_interval", "4",
           "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
           "--data.train_size", "96", "--data.val_size", "16", "--trainer.default_root_dir", str(tmp_path),
           "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = dict(kv.split("=") for kv in re.search(r"final (.*)", done.stdout).group(1).split())
    batch = 16   # the recipe's data.batch_size, one rank
    step_time = float(final["throughput/step_time_sec"])
    # the final line prints 6 decimals: a fast step's time is rounded by up to 5e-7 s, relatively 5e-7 / step_time
    assert float(final["throughput/samples_per_sec"]) * step_time == \
        pytest.approx(batch, rel=1e-5 + 1e-6 / step_time)
    assert float(final["throughput/tokens_per_sec"]) == pytest.approx(float(final["throughput/samples_per_sec"]) * 32,
                                                                       rel=1e-5)
    assert "throughput/tflops_per_device" in final and "throughput/mfu" not in final   # CPU: no peak FLOP/s
    [metrics_file] = glob.glob(str(tmp_path / "lightning_logs" / "*" / "metrics.csv"))
    rows = [row for row in csv.DictReader(open(metrics_file)) if row.get("throughput/tokens_per_sec")]
    assert [row["step"] for row in rows] == ["1", "3"], rows   # steps 2 and 4 (the logger counts from 0)
