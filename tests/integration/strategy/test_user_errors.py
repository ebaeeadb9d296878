"""Errors a user meets first, checked from the public API: each names the user's own parameter (not
an internal one), its value and the fix, and every rank raises it the same way."""

import os

import pytest
import torch.distributed as dist

from lightning_megatron.models import BertModel, GPTModel
from lightning_megatron.parallel import ParallelConfigError, ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig

from helpers.paths import ROOT

# --- model sizes that do not split over the tensor-parallel ranks ------------------------------------


def _config(**overrides):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(overrides)
    return TransformerConfig(**base)


def _model_size_errors():
    ParallelState(ParallelLayout(dist.get_world_size(), tp=dist.get_world_size())).activate()
    builds = {
        "ffn gelu": lambda: GPTModel(_config(ffn_hidden_size=30), 64, 8),
        "ffn swiglu": lambda: GPTModel(_config(ffn_hidden_size=30, activation="swiglu"), 64, 8),
        "ffn bert": lambda: BertModel(_config(ffn_hidden_size=30, attn_mask_type="padding"), 64, 8),
        "heads": lambda: GPTModel(_config(hidden_size=12, num_attention_heads=6), 64, 8),
        "fine": lambda: GPTModel(_config(ffn_hidden_size=32), 64, 8),
    }
    out = {}
    for name, build in builds.items():
        try:
            build()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def test_sizes_that_do_not_split_over_tp_name_the_config_field_and_tensor_model_parallel_size():
    per_rank = run_on_ranks(_model_size_errors, 4, timeout=120)
    assert all(r == per_rank[0] for r in per_rank)
    errors = per_rank[0]
    assert errors["fine"] is None
    for name in ("ffn gelu", "ffn swiglu", "ffn bert"):
        message = errors[name]
        assert "ffn_hidden_size=30 is not divisible by tensor_model_parallel_size=4" in message, message
        assert "output_size" not in message and "stride" not in message, message
        assert "multiple of 4 (e.g. 28 or 32)" in message and "tensor_model_parallel_size that divides 30" in message
    heads = errors["heads"]
    assert "num_attention_heads=6 is not divisible by tensor_model_parallel_size=4" in heads, heads
    assert "multiple of 4 (e.g. 4 or 8)" in heads and "tensor_model_parallel_size that divides 6 (e.g. 2 or 3)" in heads


# --- world sizes that the parallel sizes do not divide -------------------------------------------------


def test_dense_world_size_error_names_the_strategy_arguments():
    with pytest.raises(ParallelConfigError) as info:
        ParallelLayout(world_size=6, tp=2, cp=2, pp=1)
    message = str(info.value)
    for part in ("world_size=6", "tensor_model_parallel_size (tp)=2", "context_parallel_size (cp)=2",
                 "pipeline_model_parallel_size (pp)=1", "= 4", "multiple of 4"):
        assert part in message, message
    assert "tp*cp*pp" not in message


def test_expert_world_size_error_names_the_strategy_arguments():
    with pytest.raises(ParallelConfigError) as info:
        ParallelLayout(world_size=8, tp=2, ep=8)
    message = str(info.value)
    for part in ("world_size=8", "expert_tensor_parallel_size (etp)=2", "expert_model_parallel_size (ep)=8",
                 "pipeline_model_parallel_size (pp)=1", "= 16", "defaults to tensor_model_parallel_size"):
        assert part in message, message
    assert "etp*ep*pp" not in message


# --- ckpt_path that is not a checkpoint folder ----------------------------------------------------------


def _fit_from(path, fn="fit"):
    import lightning as L
    import torch
    from helpers.strategy_utils import TinyGPT, TokenData

    from lightning_megatron import MegatronStrategy

    trainer = L.Trainer(strategy=MegatronStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(TokenData(n=8), batch_size=4)
    try:
        getattr(trainer, fn)(TinyGPT(layers=1), loader, ckpt_path=path)
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("what", ["file", "folder", "file/validate"])
def test_ckpt_path_that_is_no_checkpoint_folder_says_what_one_is(tmp_path, what):
    if what.startswith("file"):
        path = tmp_path / "weights.bin"
        path.write_bytes(os.urandom(256))
    else:
        path = tmp_path / "run"
        path.mkdir()
        (path / "notes.txt").write_text("not a checkpoint")
    fn = "validate" if what.endswith("validate") else "fit"
    error = run_on_ranks(_fit_from, 1, str(path), fn, timeout=120)[0]
    assert error is not None
    kind, message = error
    assert "optimizers=None" not in message, message
    assert f"{path} is not a lightning-megatron sharded checkpoint folder" in message, message
    assert ".metadata" in message and ".distcp" in message, message
    assert "ModelCheckpoint" in message and "trainer.save_checkpoint" in message, message


# --- a launcher that started fewer processes than devices x num_nodes -----------------------------------

_LAUNCHED_SCRIPT = """
import lightning as L, torch
from lightning_megatron import MegatronStrategy

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2), devices=2, accelerator="cpu",
                    max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2))
"""


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_fewer_launched_processes_than_devices_is_one_clear_error(tmp_path, launcher):
    """torchrun/srun made a world of 1 while the Trainer says devices=2: Lightning's check of the launcher's
    settings names devices (it was a bare IndexError on the ranks that do not exist)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", PYTHONPATH=ROOT)
    if launcher == "torchrun":
        env.update(TORCHELASTIC_RUN_ID="x", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", GROUP_RANK="0",
                   LOCAL_WORLD_SIZE="1")
    else:
        env.update(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID="0",
                   SLURM_LOCALID="0", SLURM_JOB_NAME="job", SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1")
    script = tmp_path / "fit.py"
    script.write_text(_LAUNCHED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ValueError" in done.stderr and "devices=2" in done.stderr, done.stderr[-3000:]
    assert "IndexError" not in done.stderr, done.stderr[-3000:]


def _fit_whose_model_fails():
    import lightning as L
    import torch

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.parallel import has_parallel_state

    class Broken(L.LightningModule):
        def configure_model(self):
            GPTModel(_config(hidden_size=12, num_attention_heads=6), 64, 8)   # 6 heads do not split over tp=4

        def training_step(self, batch, batch_idx):
            raise AssertionError("unreachable")

        def configure_optimizers(self):
            raise AssertionError("unreachable")

    trainer = L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"])),
                        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Broken(), torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2))
    except ValueError as err:
        return "num_attention_heads=6" in str(err), has_parallel_state()
    return False, has_parallel_state()


def test_a_model_that_fails_to_build_leaves_no_parallel_state_active():
    """The next model built in the process (a notebook's retry) must not find the failed run's groups."""
    assert run_on_ranks(_fit_whose_model_fails, 4, timeout=120) == [(True, False)] * 4
