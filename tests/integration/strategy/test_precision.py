"""Precision plugins under the strategy: ranks agree on skipped 16-mixed steps; unknown plugins are refused."""

import lightning as L
import pytest
import torch

from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_megatron import MegatronStrategy
from lightning_megatron.adapter.precision import ParallelGradScaler, ParallelMixedPrecision
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import fit_tiny_gpt


def _scaler_step(rank_with_overflow):
    rank = torch.distributed.get_rank()
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = ParallelGradScaler("cpu", init_scale=8.0)
    scaler.scale(param.sum()).backward()                       # grad 8 = the scale
    if rank == rank_with_overflow:
        param.grad[0] = float("inf")
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return param.detach().clone(), scaler.get_scale()


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_on_ranks(_scaler_step, 2, 1, timeout=60)
    for param, scale in results:
        torch.testing.assert_close(param, torch.ones(3))   # nobody stepped
        assert scale == 4.0                                 # and every scaler backed off
    stepped = run_on_ranks(_scaler_step, 2, -1, timeout=60)
    for param, scale in stepped:
        torch.testing.assert_close(param, torch.full((3,), 0.5))   # no overflow: everyone stepped
        assert scale == 8.0


class _OverflowOnRankOne(L.Callback):
    """An inf in the gradients of pipeline stage 1 only (what an fp16 overflow in one shard looks like)."""

    def __init__(self):
        self.before, self.after, self.scales = None, None, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = [p.detach().clone() for p in module.parameters()]

    def on_after_backward(self, trainer, module):
        if trainer.global_rank == 1:
            next(p for p in module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after = [p.detach().clone() for p in module.parameters()]
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _fit_16_mixed_pp2():
    probe = _OverflowOnRankOne()
    fit_tiny_gpt({"pipeline_model_parallel_size": 2, "micro_batch_size": 2}, max_steps=1,
                 trainer_kwargs={"plugins": [MixedPrecision("16-mixed", "cpu")], "callbacks": [probe]})
    return [torch.equal(a, b) for a, b in zip(probe.before, probe.after)], probe.scales


def test_16_mixed_under_pipeline_parallelism_skips_the_step_on_every_stage():
    for unchanged, scales in run_on_ranks(_fit_16_mixed_pp2, 2, timeout=180):
        assert unchanged and all(unchanged), "a stage stepped although another stage's gradients overflowed"
        assert scales == [2.0**15]


def test_each_precision_gets_its_parallel_plugin():
    def plugin_of(precision):
        # Lightning turns precision="16-mixed" into bf16 on CPU: name the plugin to get a scaler here
        plugins = [MixedPrecision("16-mixed", "cpu")] if precision == "16-mixed" else None
        trainer = L.Trainer(strategy=MegatronStrategy(), accelerator="cpu", devices=1,
                            **({"plugins": plugins} if plugins else {"precision": precision}))
        from lightning_megatron.adapter.precision import parallel_precision
        return parallel_precision(trainer.precision_plugin, None)

    mixed = plugin_of("16-mixed")
    assert isinstance(mixed, ParallelMixedPrecision) and isinstance(mixed.scaler, ParallelGradScaler)
    assert plugin_of("bf16-mixed").scaler is None
    assert plugin_of("bf16-true").precision == "bf16-true"


def test_a_custom_precision_plugin_is_refused_with_the_fix():
    from lightning.pytorch.plugins.precision import Precision

    class MyPrecision(Precision):
        pass

    from lightning_megatron.adapter.precision import parallel_precision

    with pytest.raises(ValueError, match=r"plugins=\[MyPrecision\(...\)\].*precision='32-true'"):
        parallel_precision(MyPrecision(), None)
