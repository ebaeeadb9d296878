"""Lightning's backward hooks under the schedule: ``on_before_backward`` per micro-batch on the last
pipeline stage with the loss about to be backpropagated, ``on_after_backward`` once per batch."""

import lightning as L
import pytest

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, fit_tiny_gpt


class Recorder(L.Callback):
    def __init__(self):
        self.before, self.after = [], 0

    def on_before_backward(self, trainer, module, loss):
        self.before.append(float(loss))

    def on_after_backward(self, trainer, module):
        self.after += 1


class HookedGPT(TinyGPT):
    def on_train_start(self):
        self.module_before = []

    def on_before_backward(self, loss):
        self.module_before.append(float(loss))

    def on_train_end(self):
        callback = next(c for c in self.trainer.callbacks if isinstance(c, Recorder))
        self.sums = {"callback": callback.before, "module": self.module_before, "after": callback.after,
                     "last_stage": self.trainer.strategy._state().is_pipeline_last_stage()}


def _fit(kwargs, accumulate):
    return fit_tiny_gpt(kwargs, module_cls=HookedGPT, max_steps=2,
                        trainer_kwargs=dict(callbacks=[Recorder()], accumulate_grad_batches=accumulate))


@pytest.mark.parametrize("kwargs, accumulate", [(dict(pipeline_model_parallel_size=2, micro_batch_size=2), 1),
                                                (dict(micro_batch_size=2), 2)])
def test_backward_hooks_follow_the_micro_batches(kwargs, accumulate):
    for out in run_on_ranks(_fit, 2, kwargs, accumulate, timeout=180):
        probe, losses = out["probe"], out["losses"]
        batches = 2 * accumulate                                      # 2 optimizer steps
        assert probe["after"] == batches
        if not probe["last_stage"]:
            assert probe["callback"] == probe["module"] == []
            continue
        micro = len(probe["callback"]) // batches
        per_rank_batch = 8 // (2 if "pipeline_model_parallel_size" not in kwargs else 1)
        assert micro == per_rank_batch // 2                          # one call per micro-batch of 2 samples
        assert probe["module"] == probe["callback"]
        # the values are the micro-batch losses over accumulate: their mean per batch times accumulate is the
        # batch loss this rank computed (under DP the reported loss is the global mean: compare under PP only)
        if "pipeline_model_parallel_size" in kwargs:
            per_batch = [sum(probe["callback"][i * micro:(i + 1) * micro]) / micro * accumulate
                         for i in range(batches)]
            assert per_batch == pytest.approx(losses, rel=1e-5)
