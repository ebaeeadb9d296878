"""Trainer(strategy="megatron") trains a tiny GPT to the single-process losses under every layout."""

import pytest

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import assert_same_updates, fit_and_record

LAYOUTS = {
    "dp2": (2, dict()),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
    "tp2pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2)),
    "pp2vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, micro_batch_size=2)),
    "dp2tp2": (4, dict(tensor_model_parallel_size=2)),
    "cp2": (2, dict(context_parallel_size=2)),
    "tp2cp2sp": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True)),
    "pp2cp2": (4, dict(pipeline_model_parallel_size=2, context_parallel_size=2, micro_batch_size=2)),
    "dp2cp2": (4, dict(context_parallel_size=2)),
    # per-layer graph bookkeeping (capture, static buffers, replay order) without a GPU
    "pp2graphs": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2, cuda_graph="partial",
                          cuda_graph_backend="eager")),
    "pp2vpp2fullgraph": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                 micro_batch_size=2, cuda_graph="full", cuda_graph_backend="eager")),
    "dp2tp2fullgraph": (4, dict(tensor_model_parallel_size=2, micro_batch_size=2, cuda_graph="full",
                                cuda_graph_backend="eager")),
}


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(fit_and_record, 1, dict(), max_steps=4, trainer_kwargs=dict(gradient_clip_val=0.05),
                        timeout=120)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_match_single_process_with_clipping(reference, name):
    world, kwargs = LAYOUTS[name]
    out = run_on_ranks(fit_and_record, world, kwargs, max_steps=4, trainer_kwargs=dict(gradient_clip_val=0.05),
                       timeout=180)
    # clipped by the norm of the whole model: the clip coefficient (hence every parameter) needs the right norm
    assert_same_updates(out[0]["params"], reference["params"])
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        assert rank_out["logged"]["train_loss"] == pytest.approx(reference["logged"]["train_loss"], rel=1e-5)
