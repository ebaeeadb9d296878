"""Gradient-accumulation fusion on a GPU (``tensor_parallel/grad_accumulation.py``): compiled layers (inductor)
accumulating their weight gradients by the GEMM equal the plain path (float32, micro-batches of 2, with the
data-parallel buffers' overlapped reduction on two GPUs), and compiled layers inside a CUDA graph are refused with
the fix."""

import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import assert_same_updates, fit_and_record

pytestmark = pytest.mark.gpu


def _fit(world, fused, **strategy_kwargs):
    return run_on_ranks(fit_and_record, world, dict(micro_batch_size=2, compile_layers=True, **strategy_kwargs),
                        dict(gradient_accumulation_fusion=fused), accelerator="gpu", backend="nccl",
                        init_process_group=False, timeout=600)


def _assert_same(fused, plain):
    assert_same_updates(fused[0]["params"], plain[0]["params"], rtol=1e-4, atol=1e-5)
    for got, ref in zip(fused, plain):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def test_fused_accumulation_with_compiled_layers_equals_the_plain_path():
    _assert_same(_fit(1, True), _fit(1, False))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fused_accumulation_into_overlapped_buffers_equals_the_plain_path_on_two_gpus():
    buffers = dict(overlap_grad_reduce=True, use_distributed_optimizer=True)
    _assert_same(_fit(2, True, **buffers), _fit(2, False, **buffers))


def test_fused_accumulation_with_compiled_layers_in_a_cuda_graph_is_refused():
    with pytest.raises(Exception, match="gradient_accumulation_fusion=True does not combine compiled layers with "
                                        "CUDA graphs"):
        _fit(1, True, cuda_graph="partial")
