"""Partial CUDA graphs through the Trainer on a GPU, real graphs: the replays deliver parameter gradients by hand
(``cuda_graphs/runner.py``), so the gradient buffers' hooks (overlapped reduction, distributed optimizer) and the
accumulation over micro-batches must come out as eager training's. Float32, micro-batches of 2 (four a step),
per layer and per block, with dropout in one case (the graphs' masks are eager's)."""

import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import assert_same_updates, fit_and_record

pytestmark = pytest.mark.gpu

BUFFERS = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)


def _fit(dropout, **strategy_kwargs):
    return run_on_ranks(fit_and_record, 1, dict(micro_batch_size=2, **strategy_kwargs), dict(dropout=dropout),
                        max_steps=5, accelerator="gpu", backend="nccl", init_process_group=False, timeout=600)[0]


@pytest.mark.parametrize("scope, buffers, dropout", [("layer", {}, 0.0), ("layer", BUFFERS, 0.0),
                                                      ("block", BUFFERS, 0.0), ("block", BUFFERS, 0.1)],
                         ids=["layer", "layer-distopt", "block-distopt", "block-distopt-dropout"])
def test_partial_graphs_through_the_trainer_train_like_eager(scope, buffers, dropout):
    eager = _fit(dropout, **buffers)
    graphed = _fit(dropout, cuda_graph="partial", cuda_graph_scope=scope, **buffers)
    assert_same_updates(graphed["params"], eager["params"], rtol=1e-5, atol=1e-6)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-5)


def _fit_tp2(fp8, **strategy_kwargs):
    from lightning_megatron.quantization.float8 import Float8Config

    kwargs = dict(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=2, **strategy_kwargs)
    if fp8:   # real float8 GEMMs, each weight cast once per step (the column-parallel linears' split GEMMs)
        kwargs["fp8"] = Float8Config("tensorwise")
    return run_on_ranks(fit_and_record, 2, kwargs, dict(dropout=0.1), max_steps=5, accelerator="gpu",
                        backend="nccl", init_process_group=False, timeout=600)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fp8", [False, True], ids=["tp2sp", "tp2sp-float8"])
def test_partial_graphs_at_tp2_with_sequence_parallelism_train_like_eager(fp8):
    """Per-block graphs at tp2 + SP over NCCL (the sequence-parallel collectives and the column-parallel linears'
    input-gradient collectives captured): equal to eager training, float32 (float8 GEMMs too, with ``fp8``)."""
    eager = _fit_tp2(fp8)
    graphed = _fit_tp2(fp8, cuda_graph="partial", cuda_graph_scope="block")
    assert_same_updates(graphed[0]["params"], eager[0]["params"], rtol=1e-5, atol=1e-6)
    for rank_graphed, rank_eager in zip(graphed, eager):
        assert rank_graphed["losses"] == pytest.approx(rank_eager["losses"], rel=1e-5)
