"""Partial CUDA graphs through the Trainer on a GPU, real graphs: the replays deliver parameter gradients by hand
(``cuda_graphs/runner.py``), so the gradient buffers' hooks (overlapped reduction, distributed optimizer) and the
accumulation over micro-batches must come out as eager training's. Float32, micro-batches of 2 (four a step),
per layer and per block, with dropout in one case (the graphs' masks are eager's)."""

import pytest

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
