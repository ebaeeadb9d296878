"""``pipeline_schedule="zb-h1"`` (zero-bubble 1F1B) gives one process's losses, gradients and updates.

As ``test_strategy_updates.py``: unclipped SGD (lr 2) makes every parameter after a step the previous one
minus 2·gradient, so a weight gradient that is lost (a W step that never runs), counted twice, computed
before its backward, or left out of the data-parallel reduction shows far beyond the tolerance. AdamW
checks the update of a stateful optimizer over the same steps. The layouts: pp2 and pp4 (one layer per
stage, eight micro-batches), tp2 + sequence parallelism with pp2, and dp2·pp2 with the distributed
optimizer and overlapped bucket reduction (buckets reduced as the last micro-batch's W steps fill them), and
compiled layers (the deferring linears traced into their graphs) with and without data parallelism and under
tp2 + sequence parallelism (the collectives stay graph breaks between the traced pieces).
"""

import types

import pytest
import torch

from lightning_megatron.engine.step import _check_schedule
from lightning_megatron.parallel import ParallelConfigError
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, assert_same_run, assert_same_updates, fit_and_record

ZB = dict(pipeline_schedule="zb-h1")
LAYOUTS = {
    "pp2": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
    "pp4": (4, dict(pipeline_model_parallel_size=4, micro_batch_size=1)),
    "tp2sp-pp2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
                          micro_batch_size=2)),
    "dp2pp2-distopt-overlap": (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2, use_distributed_optimizer=True,
                                       overlap_grad_reduce=True, bucket_size=600)),
    # compiled layers (dynamo + AOTAutograd, eager backend): each deferring linear is a graph break
    "pp2-compiled": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2,
                             compile_layers=dict(backend="aot_eager"))),
    "tp2sp-pp2-compiled": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
                                   micro_batch_size=2, compile_layers=dict(backend="aot_eager"))),
    # compiled with data-parallel hooks: the compiled backward reaches each deferred weight's accumulator with no
    # gradient, which fires its hook without one (the buffers must neither fail nor count the weight ready)
    "dp2pp2-distopt-overlap-compiled": (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2,
                                                use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                bucket_size=600, compile_layers=dict(backend="aot_eager"))),
}


class AdamWGPT(TinyGPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(fit_and_record, 1, dict(), timeout=120)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_bubble_updates_match_single_process(reference, name):
    world, kwargs = LAYOUTS[name]
    out = run_on_ranks(fit_and_record, world, dict(kwargs, **ZB), timeout=240)
    assert_same_run(out, reference)


def test_zero_bubble_adamw_updates_match_1f1b_exactly_and_single_process():
    """AdamW divides by the gradient's running size, so a near-zero gradient element that one process and any
    micro-batched run sum in a different order moves by up to ~lr: 1F1B itself is 4e-6 away from one process
    here. ZB-H1 computes every gradient as 1F1B does (the same products, summed in the same order): equal
    bit for bit."""
    ref = run_on_ranks(fit_and_record, 1, dict(), module_cls=AdamWGPT, timeout=120)[0]
    runs = {schedule: run_on_ranks(fit_and_record, 2, dict(LAYOUTS["pp2"][1], pipeline_schedule=schedule),
                                   module_cls=AdamWGPT, timeout=240) for schedule in ("1f1b", "zb-h1")}
    assert_same_updates(runs["zb-h1"][0]["params"], runs["1f1b"][0]["params"], rtol=0, atol=0)
    assert_same_updates(runs["zb-h1"][0]["params"], ref["params"], rtol=1e-5, atol=1e-5)
    assert runs["zb-h1"][1]["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)


def test_zero_bubble_refuses_what_it_cannot_run():
    with pytest.raises(ParallelConfigError, match="virtual_pipeline_model_parallel_size=2"):
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, micro_batch_size=1,
                       pipeline_schedule="zb-h1")
    with pytest.raises(ParallelConfigError, match="pipeline_schedule='zero_bubble' is not one of"):
        ParallelConfig(pipeline_schedule="zero_bubble")
    state = types.SimpleNamespace(virtual_pipeline_size=None)
    with pytest.raises(ValueError, match="cuda_graph='partial'"):
        _check_schedule("zb-h1", torch.nn.Linear(2, 2), state, "partial")
    float8_linear = torch.nn.Linear(2, 2)
    float8_linear.float8 = object()
    with pytest.raises(ValueError, match="fp8"):
        _check_schedule("zb-h1", torch.nn.Sequential(float8_linear), state, None)
    assert _check_schedule("1f1b", torch.nn.Sequential(float8_linear), state, "partial") == "1f1b"


@pytest.mark.parametrize("compile_layers", [False, dict(backend="aot_eager")], ids=["eager", "compiled"])
def test_zero_bubble_with_recomputed_layers_matches_single_process(reference, compile_layers):
    """Recomputed layers run their forward again inside B; their deferring linears' backward then runs inside the B
    step too, so their weight gradients wait for W as the others do (the queue is the one active at the backward)."""
    out = run_on_ranks(fit_and_record, 2, dict(LAYOUTS["pp2"][1], compile_layers=compile_layers, **ZB),
                       module_kwargs=dict(recompute_layers=True), timeout=240)
    assert_same_run(out, reference)
