"""``python -m lightning_megatron fit --config ...`` as a user runs it, on 1 and on 2 CPU ranks."""

import math
import os
import re
import subprocess
import sys

import pytest

from helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "examples", "gpt_tiny.yaml")
MOE_CONFIG = os.path.join(ROOT, "examples", "gpt_moe_tiny.yaml")


def run_cli(*overrides, timeout=240, config=CONFIG):
    cmd = [sys.executable, "-m", "lightning_megatron", "fit", "--config", config, "--trainer.max_steps", "6",
           "--trainer.val_check_interval", "6", "--trainer.enable_progress_bar", "false",
           "--data.train_size", "96", "--data.val_size", "32", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"final (.*)", done.stdout)
    assert found, done.stdout[-2000:]
    return dict(kv.split("=") for kv in found.group(1).split())


def test_cli_runs_the_yaml_recipe_and_tensor_parallel_matches(tmp_path):
    single = run_cli("--trainer.default_root_dir", str(tmp_path / "one"))
    parallel = run_cli("--trainer.default_root_dir", str(tmp_path / "two"), "--trainer.devices", "2",
                       "--trainer.strategy.tensor_model_parallel_size", "2")
    assert float(parallel["train_loss"]) == pytest.approx(float(single["train_loss"]), rel=1e-4)
    assert float(parallel["val_loss"]) == pytest.approx(float(single["val_loss"]), rel=1e-4)


def test_strategy_by_name_in_yaml(tmp_path):
    out = run_cli("--trainer.default_root_dir", str(tmp_path), "--trainer.strategy", "megatron")
    # It trains (GPTModel runs only under the megatron strategy's process groups): a model that predicts
    # uniformly scores ln(64) = 4.16 nats; 6 steps bring it to ~3.7 (with lr 0 it stays at ~4.2).
    uniform = math.log(64)
    assert float(out["train_loss"]) < uniform - 0.3 and float(out["val_loss"]) < uniform - 0.3, out


def test_cli_moe_recipe_with_expert_parallelism_and_echo_matches_one_rank(tmp_path):
    """The MoE example from YAML: 2 ranks with the experts split over them (EP2, one ECHO spare slot per
    rank) and half the per-rank batch (the same global batch) train like 1 rank."""
    single = run_cli("--trainer.default_root_dir", str(tmp_path / "one"), config=MOE_CONFIG)
    parallel = run_cli("--trainer.default_root_dir", str(tmp_path / "two"), "--trainer.devices", "2",
                       "--trainer.strategy.expert_model_parallel_size", "2",
                       "--model.moe.num_spare_experts_per_ep_rank", "1", "--data.batch_size", "8", config=MOE_CONFIG)
    assert float(parallel["train_loss"]) == pytest.approx(float(single["train_loss"]), rel=1e-4)
    assert float(parallel["val_loss"]) == pytest.approx(float(single["val_loss"]), rel=1e-4)


def run_command(*args, env_extra=None, timeout=240, cwd=ROOT):
    """``python -m lightning_megatron ARGS`` as typed, without the launcher's rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                            "LIGHTNING_MEGATRON_TRACEBACK")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "lightning_megatron", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_usage_names_the_command_and_parsing_gives_no_args_warning():
    done = run_command("fit", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert done.stdout.startswith("usage: python -m lightning_megatron"), done.stdout[:300]
    assert "__main__.py" not in out, out[:500]
    assert "args parameter" not in out, out[-2000:]


def test_strategy_short_name_takes_options():
    done = run_command("fit", "--config", CONFIG, "--trainer.strategy", "megatron",
                       "--trainer.strategy.tensor_model_parallel_size", "2", "--trainer.devices", "2",
                       "--print_config")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "args parameter" not in done.stderr, done.stderr[-2000:]
    assert "class_path: lightning_megatron.MegatronStrategy" in done.stdout, done.stdout
    assert re.search(r"^\s+tensor_model_parallel_size: 2$", done.stdout, re.M), done.stdout
    assert re.search(r"^\s+devices: '?2'?$", done.stdout, re.M), done.stdout
    # The ``=`` spelling too.
    done = run_command("fit", "--config", CONFIG, "--trainer.strategy=megatron",
                       "--trainer.strategy.pipeline_model_parallel_size", "2", "--model.pipeline_layout", "[3, 1]",
                       "--print_config")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^\s+pipeline_model_parallel_size: 2$", done.stdout, re.M), done.stdout
    assert re.search(r"^\s+pipeline_layout:\n\s+- 3\n\s+- 1$", done.stdout, re.M), done.stdout


BAD_LAYOUT = ("fit", "--config", CONFIG, "--trainer.devices", "2", "--trainer.strategy.tensor_model_parallel_size", "3",
              "--trainer.enable_progress_bar", "false")


def test_user_error_is_one_message_on_rank_zero_and_traceback_on_request(tmp_path):
    done = run_command(*BAD_LAYOUT, "--trainer.default_root_dir", str(tmp_path))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    # One message for the two ranks, naming the error and the fix, and how to see the traceback.
    assert done.stderr.count("error: ParallelConfigError:") == 1, done.stderr[-3000:]
    assert "not divisible by tensor_model_parallel_size" in done.stderr, done.stderr[-3000:]
    assert "LIGHTNING_MEGATRON_TRACEBACK=1" in done.stderr
    # A missing data directory: a FileNotFoundError, one line too.
    done = run_command("fit", "--config", os.path.join(ROOT, "examples", "mnli_tiny.yaml"),
                       "--data.data_dir", str(tmp_path / "no_such_dir"), "--trainer.default_root_dir", str(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(r"^error: FileNotFoundError: .*no_such_dir", done.stderr, re.M), done.stderr[-3000:]
    # The full traceback behind the environment variable.
    done = run_command(*BAD_LAYOUT, "--trainer.default_root_dir", str(tmp_path),
                       env_extra={"LIGHTNING_MEGATRON_TRACEBACK": "1"})
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "ParallelConfigError" in done.stderr, done.stderr[-3000:]


def test_unexpected_error_keeps_its_traceback(tmp_path):
    (tmp_path / "broken_model.py").write_text(
        "import lightning.pytorch as pl\n\n"
        "class Broken(pl.LightningModule):\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        return None\n\n"
        "    def configure_optimizers(self):\n"
        "        return None\n\n"
        "    def setup(self, stage):\n"
        "        raise RuntimeError('a bug, not a user error')\n")
    done = run_command("fit", "--config", CONFIG, "--model", "broken_model.Broken",
                       "--trainer.default_root_dir", str(tmp_path),
                       env_extra={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "RuntimeError: a bug, not a user error" in done.stderr, done.stderr[-3000:]
    assert "LIGHTNING_MEGATRON_TRACEBACK" not in done.stderr


@pytest.mark.parametrize("config, layout", [
    (CONFIG, ()),   # plain data parallel: each rank sees half the batches of an epoch
    (MOE_CONFIG, ("--trainer.strategy.expert_model_parallel_size", "2")),   # EP2 without --data.batch_size 8
], ids=["gpt_dp2", "moe_ep2"])
def test_recipe_at_two_ranks_validates_and_saves_at_the_last_step(tmp_path, config, layout):
    """The recipes' val_check_interval counts steps over epochs: it may exceed one epoch's batches per rank
    (here 3 of them, 96 samples / 2 ranks / 16), and the last step validates and keeps its checkpoint."""
    out = run_cli("--trainer.default_root_dir", str(tmp_path), "--trainer.devices", "2", "--trainer.max_steps", "8",
                  "--trainer.val_check_interval", "4", *layout, config=config)
    assert "val_loss" in out and "train_loss" in out, out
    saved = [name for _, dirs, files in os.walk(tmp_path) for name in dirs + files if name.endswith(".ckpt")]
    assert any("step=8" in name for name in saved) and not any("step=4" in name for name in saved), saved
