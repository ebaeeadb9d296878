"""``TransformerConfig(gradient_accumulation_fusion=True)``: the linears' weight gradients accumulated by their GEMMs
(``tensor_parallel/grad_accumulation.py``) give one process's losses and updates.

Unclipped SGD (lr 2), micro-batches of 2 (four per step, so every weight's gradient is a sum the GEMMs accumulate):
a micro-batch's product lost, added twice, written over the sum, or left out of the data-parallel reduction (its
bucket never counted ready, or counted before the product landed) shows far beyond the tolerance. The paths:
``.grad`` (one process, tp2 with and without sequence parallelism: the column linear's own backward), the
data-parallel buffers' ``main_grad`` with overlapped bucket reduction and the distributed optimizer, pipelines
(1F1B, and ZB-H1, whose deferred weights keep their own accumulation), and compiled layers (the linear traced,
the accumulation a custom op in the backward graph)."""

import pytest

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import assert_same_run, fit_and_record

FUSED = dict(gradient_accumulation_fusion=True)
TRACED = dict(compile_layers=dict(backend="aot_eager"))
MB2 = dict(micro_batch_size=2)
LAYOUTS = {
    "one-process": (1, dict(MB2)),
    "tp2": (2, dict(MB2, tensor_model_parallel_size=2)),
    "tp2sp": (2, dict(MB2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "dp2-overlap": (2, dict(MB2, overlap_grad_reduce=True, bucket_size=600)),
    "dp2tp2sp-distopt-overlap": (4, dict(MB2, tensor_model_parallel_size=2, sequence_parallel=True,
                                         use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=600)),
    "pp2": (2, dict(MB2, pipeline_model_parallel_size=2)),
    "pp2-zb": (2, dict(MB2, pipeline_model_parallel_size=2, pipeline_schedule="zb-h1")),
    "one-process-compiled": (1, dict(MB2, **TRACED)),
    "tp2sp-compiled": (2, dict(MB2, tensor_model_parallel_size=2, sequence_parallel=True, **TRACED)),
    "dp2-overlap-compiled": (2, dict(MB2, overlap_grad_reduce=True, bucket_size=600, **TRACED)),
}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(fit_and_record, 1, dict(), timeout=120)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fused_gradient_accumulation_matches_single_process(reference, name):
    world, kwargs = LAYOUTS[name]
    assert_same_run(run_on_ranks(fit_and_record, world, kwargs, FUSED, timeout=240), reference)


def _fit_counting_fusions(strategy_kwargs):
    """``fit_and_record`` with the default config (``gradient_accumulation_fusion="auto"``), counting the
    accumulations the GEMMs made (the column linears' own backward and the traced and eager sink linears')."""
    from lightning_megatron.tensor_parallel import column_backward, grad_accumulation

    original, calls = grad_accumulation.accumulate_weight_grad, []

    def counting(param, inp, grad_output):
        calls.append(tuple(param.shape))
        original(param, inp, grad_output)

    grad_accumulation.accumulate_weight_grad = column_backward.accumulate_weight_grad = counting
    try:
        out = fit_and_record(strategy_kwargs)
    finally:
        grad_accumulation.accumulate_weight_grad = column_backward.accumulate_weight_grad = original
    return dict(out, fused=len(calls))


@pytest.mark.parametrize("name", ["one-process-compiled", "tp2sp-compiled", "dp2-overlap-compiled", "one-process"])
def test_the_default_fuses_in_compiled_layers_and_matches_single_process(reference, name):
    """The default: the strategy compiles the layers, so every linear of every layer accumulates by its GEMM (four
    linears, four layers, four micro-batches a step, three steps), and the run is one process's; eager, none."""
    world, kwargs = LAYOUTS[name]
    out = run_on_ranks(_fit_counting_fusions, world, kwargs, timeout=240)
    assert_same_run(out, reference)
    per_rank = 4 * 4 * (4 // (2 if name.startswith("dp2") else 1)) * 3 if "compile_layers" in kwargs else 0
    assert [rank_out["fused"] for rank_out in out] == [per_rank] * world
