"""Every reduction path and every parallel axis gives the single process's updates, parameter by parameter.

Unclipped SGD (lr 2): the parameters after each step are the previous ones minus 2·gradient, so a
gradient divided by the wrong group size, a missing tied-embedding or sequence-parallel reduce, or
an expert gradient averaged over the wrong ranks changes them far beyond the tolerance. The paths:
plain ``.grad`` finalize, gradient buffers (several buckets), overlapped bucket reduction, and the
distributed optimizer (with overlapped parameter gathers); the axes: dp, cp, tp duplicates (sequence
parallel), pp (tied embeddings), vpp, ep/edp/etp. MoE runs have the balancing losses on (aux, z).

The balancing losses are functions of a micro-batch's whole token set (its expert load), so MoE runs
use one sample per micro-batch: every layout then forms the same micro-batches as one process.
"""

import pytest

from lightning_megatron.moe import MoEConfig
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import AuxLoggingGPT, assert_same_run, assert_same_updates, fit_and_record

SMALL_BUCKETS = dict(bucket_size=600)   # the tiny GPT's ~13k elements in many buckets

DENSE = {
    "dp2": (2, dict()),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "cp2": (2, dict(context_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
    "pp2vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, micro_batch_size=2)),
    "dp2cp2": (4, dict(context_parallel_size=2)),
    "dp2tp2": (4, dict(tensor_model_parallel_size=2)),
    "tp2pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2)),
    "tp2cp2sp": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True)),
    # gradient buffers
    "dp2tp2sp-buffers": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, **SMALL_BUCKETS)),
    "dp2cp2-buffers": (4, dict(context_parallel_size=2, **SMALL_BUCKETS)),
    "dp2pp2-buffers": (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2, **SMALL_BUCKETS)),
    # overlapped bucket reduction
    "dp2cp2-overlap": (4, dict(context_parallel_size=2, overlap_grad_reduce=True, **SMALL_BUCKETS)),
    "dp2pp2-overlap": (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2, overlap_grad_reduce=True,
                               **SMALL_BUCKETS)),
    "dp2tp2sp-overlap": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, overlap_grad_reduce=True,
                                 **SMALL_BUCKETS)),
    # distributed optimizer
    "dp4-distopt": (4, dict(use_distributed_optimizer=True)),
    "dp2cp2-distopt": (4, dict(context_parallel_size=2, use_distributed_optimizer=True, overlap_grad_reduce=True,
                               **SMALL_BUCKETS)),
    "dp2tp2sp-distopt": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True)),
    # CUDA-graph bookkeeping (capture, static buffers, replay order) with the eager backend
    "pp2-partial-graphs": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2, cuda_graph="partial",
                                   cuda_graph_backend="eager")),
    # a chunk's layers in one graph (cuda_graph_scope="block"), per virtual chunk
    "pp2vpp2-block-graphs": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                     micro_batch_size=2, cuda_graph="partial", cuda_graph_scope="block",
                                     cuda_graph_backend="eager")),
    "dp2tp2-full-graph": (4, dict(tensor_model_parallel_size=2, micro_batch_size=2, cuda_graph="full",
                                  cuda_graph_backend="eager")),
    "dp2pp2-distopt-gather": (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2,
                                      use_distributed_optimizer=True, overlap_param_gather=True)),
    # per-layer graphs with overlapped gathers (the layer waits before its body, param_buffer.py; the eager backend
    # runs the submodules, so only a GPU replay would skip their hooks)
    "dp2-partial-graphs-distopt-gather": (2, dict(micro_batch_size=2, cuda_graph="partial", cuda_graph_backend="eager",
                                                  use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                  overlap_param_gather=True, **SMALL_BUCKETS)),
    "dp2tp2sp-block-graphs-distopt-gather": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                     micro_batch_size=2, cuda_graph="partial",
                                                     cuda_graph_scope="block", cuda_graph_backend="eager",
                                                     use_distributed_optimizer=True, overlap_param_gather=True,
                                                     **SMALL_BUCKETS)),
    # sequence-parallel communication overlapped with the GEMMs (a ring of chunks)
    "tp2sp-commoverlap": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True)),
    "tp2pp2sp-distopt-commoverlap": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                             sequence_parallel=True, tp_comm_overlap=True, micro_batch_size=2,
                                             use_distributed_optimizer=True, overlap_grad_reduce=True)),
}
# compiled layers (traced by dynamo and AOTAutograd; the eager backend runs the traced graphs: inductor's own
# numbers are tests/unit/transformer/test_compile.py's)
TRACED = dict(compile_layers=dict(backend="aot_eager"))
DENSE.update({f"{name}-compiled": (DENSE[name][0], dict(DENSE[name][1], **TRACED)) for name in (
    "tp2sp", "cp2", "pp2vpp2", "dp2pp2-distopt-gather", "pp2-partial-graphs", "pp2vpp2-block-graphs",
    "dp2tp2-full-graph", "tp2sp-commoverlap")})


@pytest.fixture(scope="module")
def dense_reference():
    return run_on_ranks(fit_and_record, 1, dict(), timeout=120)[0]


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_updates_match_single_process(dense_reference, name):
    world, kwargs = DENSE[name]
    out = run_on_ranks(fit_and_record, world, kwargs, timeout=240)
    assert_same_run(out, dense_reference)


# uneven pipeline layouts by hand (empty chunks included), with the reduction paths that walk the stages' buckets
LAYOUTS = {
    "pp2-layout-3-1": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2), [3, 1]),
    "pp2vpp2-layout-1-2-0-1": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                       micro_batch_size=2), [1, 2, 0, 1]),
    # an empty chunk has no block graph; the others one each
    "pp2vpp2-layout-1-2-0-1-block-graphs": (2, dict(pipeline_model_parallel_size=2,
                                                    virtual_pipeline_model_parallel_size=2, micro_batch_size=2,
                                                    cuda_graph="partial", cuda_graph_scope="block",
                                                    cuda_graph_backend="eager"), [1, 2, 0, 1]),
    "dp2pp2-distopt-overlap-layout-0-4": (4, dict(pipeline_model_parallel_size=2, micro_batch_size=2,
                                                  use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                  **SMALL_BUCKETS), [0, 4]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_pipeline_layouts_match_single_process(dense_reference, name):
    world, kwargs, layout = LAYOUTS[name]
    out = run_on_ranks(fit_and_record, world, kwargs, dict(pipeline_layout=layout), timeout=240)
    assert_same_updates(out[0]["params"], dense_reference["params"])
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(dense_reference["losses"], rel=1e-5, abs=1e-6)


# Gemma-style layers: GeGLU, norms scaling by 1 + weight (LayerNorm here; RMSNorm in the Hugging Face import tests),
# word embeddings times a multiplier
GEMMA_STYLE = dict(activation="geglu", layernorm_zero_centered_gamma=True, embedding_multiplier=4.0)


@pytest.fixture(scope="module")
def gemma_style_reference():
    return run_on_ranks(fit_and_record, 1, dict(), GEMMA_STYLE, timeout=120)[0]


@pytest.mark.parametrize("name", ["tp2sp", "pp2"])
def test_gemma_style_layers_match_single_process(gemma_style_reference, name):
    world, kwargs = DENSE[name]
    out = run_on_ranks(fit_and_record, world, kwargs, GEMMA_STYLE, timeout=240)
    assert_same_updates(out[0]["params"], gemma_style_reference["params"])
    norms = [n for n in gemma_style_reference["params"][0] if "norm" in n and n.endswith("weight")]
    assert norms and all(gemma_style_reference["params"][0][n].abs().max() < 0.5 for n in norms)   # centred on 0


def moe_module(dispatcher="alltoall"):
    """Every other MLP a mixture of experts, balancing losses on with coefficients large enough that
    a wrong scale of their gradient shows in the router's update."""
    return dict(moe=MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2, dispatcher=dispatcher,
                              aux_loss_coeff=0.5, z_loss_coeff=0.1),
                moe_layer_freq=2)


MOE = {
    "ep2": (2, dict(expert_model_parallel_size=2), "alltoall"),
    "dp4ep2": (4, dict(expert_model_parallel_size=2), "alltoall"),               # edp2
    "tp2": (2, dict(tensor_model_parallel_size=2), "alltoall"),                   # experts etp2
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), "allgather"),
    "cp2": (2, dict(context_parallel_size=2), "alltoall"),
    "tp2cp2sp": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True), "alltoall"),
    "cp2ep2": (2, dict(context_parallel_size=2, expert_model_parallel_size=2), "alltoall"),
    "tp2etp1": (2, dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), "alltoall"),  # edp2, dp1
    "tp2ep2etp1": (4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                           expert_tensor_parallel_size=1), "alltoall"),
    "pp2ep2": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2), "alltoall"),
    "dp4ep2-buffers": (4, dict(expert_model_parallel_size=2, overlap_grad_reduce=True, **SMALL_BUCKETS), "alltoall"),
    "dp4ep2-distopt": (4, dict(expert_model_parallel_size=2, use_distributed_optimizer=True), "alltoall"),
}


@pytest.fixture(scope="module")
def moe_reference():
    return {dispatcher: run_on_ranks(fit_and_record, 1, dict(micro_batch_size=1), moe_module(dispatcher),
                                     module_cls=AuxLoggingGPT, timeout=120)[0]
            for dispatcher in ("alltoall", "allgather")}


@pytest.mark.parametrize("name", list(MOE))
def test_moe_updates_with_balancing_losses_match_single_process(moe_reference, name):
    world, kwargs, dispatcher = MOE[name]
    ref = moe_reference[dispatcher]
    out = run_on_ranks(fit_and_record, world, dict(micro_batch_size=1, **kwargs), moe_module(dispatcher),
                       module_cls=AuxLoggingGPT, timeout=240)
    assert_same_updates(out[0]["params"], ref["params"])
    assert {"load_balancing_loss", "z_loss"} <= ref["logged"].keys()
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        if kwargs.get("pipeline_model_parallel_size", 1) == 1:   # the last stage holds every router
            assert rank_out["logged"] == pytest.approx(ref["logged"], rel=1e-5)


VALUE_CLIPPING = dict(gradient_clip_val=0.002, gradient_clip_algorithm="value")   # active on most gradients


@pytest.fixture(scope="module")
def value_clipped_reference():
    return run_on_ranks(fit_and_record, 1, dict(), trainer_kwargs=VALUE_CLIPPING, timeout=120)[0]


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp4-distopt"])
def test_value_clipping_matches_single_process(value_clipped_reference, dense_reference, name):
    """``gradient_clip_algorithm="value"`` clips each reduced gradient element (on the optimizer's shard
    under the distributed optimizer) as one process clips its own."""
    world, kwargs = DENSE[name]
    out = run_on_ranks(fit_and_record, world, kwargs, trainer_kwargs=VALUE_CLIPPING, timeout=240)
    assert_same_updates(out[0]["params"], value_clipped_reference["params"])
    with pytest.raises(AssertionError):   # the clipping is active: unclipped updates differ
        assert_same_updates(value_clipped_reference["params"], dense_reference["params"])
