"""ZB-H1 with compiled layers on two GPUs (inductor's Triton kernels, NCCL): the deferring linears are traced into
the layers' graphs, and the run equals eager 1F1B's (float32: losses and the parameters after every step)."""

import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import assert_same_updates, fit_and_record

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PP2 = dict(pipeline_model_parallel_size=2, micro_batch_size=2)


def _fit(**kwargs):
    return run_on_ranks(fit_and_record, 2, dict(PP2, **kwargs), accelerator="gpu", backend="nccl",
                        init_process_group=False, timeout=600)


def test_compiled_zero_bubble_equals_eager_1f1b_on_two_gpus():
    eager = _fit(compile_layers=False)
    compiled = _fit(compile_layers=True, pipeline_schedule="zb-h1")
    assert_same_updates(compiled[0]["params"], eager[0]["params"], rtol=1e-4, atol=1e-5)
    for got, ref in zip(compiled, eager):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
