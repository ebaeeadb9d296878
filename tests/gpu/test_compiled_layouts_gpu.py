"""Compiled layers where ``compile_layers="auto"`` made its choice by measurement (``transformer/compile.py``):
context parallelism over NCCL on two GPUs (``True`` compiles, "auto" stays eager) and the full-iteration CUDA graph
on one (``True`` compiles; "auto" stays eager there since compiled BERT-base captures failed intermittently). Inductor's kernels against eager, float32, with dropout (compiled layers draw eager's
masks): the losses and the parameters after every step. At cp2 with dropout this failed (the embedding gradient
left eager's at the first step on two H200s) until the context-parallel attention, dropout stream's fork included,
ran eagerly under compile (``transformer/context_parallel.py: context_parallel_self_attention``)."""

import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import assert_same_updates, fit_and_record

pytestmark = pytest.mark.gpu


def _fit(world, dropout, **strategy_kwargs):
    return run_on_ranks(fit_and_record, world, strategy_kwargs, dict(dropout=dropout), accelerator="gpu",
                        backend="nccl", init_process_group=False, timeout=600)


def _assert_same(compiled, eager):
    assert_same_updates(compiled[0]["params"], eager[0]["params"], rtol=1e-4, atol=1e-5)
    for got, ref in zip(compiled, eager):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_context_parallel_equals_eager_on_two_gpus(dropout):
    cp2 = dict(context_parallel_size=2)
    _assert_same(_fit(2, dropout, compile_layers=True, **cp2), _fit(2, dropout, compile_layers=False, **cp2))


def test_compiled_layers_inside_the_full_iteration_graph_equal_eager():
    full = dict(cuda_graph="full")
    _assert_same(_fit(1, 0.1, compile_layers=True, **full), _fit(1, 0.1, compile_layers=False, **full))
