"""tp_comm_overlap on GPUs, through symmetric memory's fused ops (the default on CUDA) and through the NCCL
send/receive ring: a Llama at tp 2 and 4 with sequence parallelism trains as the plain path does, float32
(gradients of the first step, three AdamW steps' losses), eager and with compiled layers."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.testing import run_on_ranks
from helpers.token_steps import adamw_steps

pytestmark = pytest.mark.gpu


def _train(overlap, steps, tp, compiled):
    import torch._dynamo

    from lightning_megatron.models import LlamaModel, llama_config
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer.compile import compile_layers

    torch.cuda.set_device(dist.get_rank())
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=tp)).activate()
    torch._dynamo.reset()
    model_parallel_seed(3)
    cfg = llama_config(4, 256, 8, num_query_groups=4, ffn_hidden_size=512, params_dtype=torch.float32,
                       sequence_parallel=True, tp_comm_overlap=overlap, hidden_dropout=0.1, attention_dropout=0.0)
    model = LlamaModel(cfg, 1024, 128).cuda()
    if compiled:
        compile_layers(model)
    losses, grads = adamw_steps(model, steps)
    state.destroy()
    return losses, grads


def _compare(tp, compiled, backend):
    import os

    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel import comm_overlap

    os.environ[comm_overlap.BACKEND_ENV] = backend
    torch.cuda.set_device(dist.get_rank())
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=tp)).activate()
    symmetric = comm_overlap._symmetric_memory(torch.zeros(1, device="cuda"), state.tp_group) is not None
    state.destroy()
    return _train(False, 3, tp, compiled), _train(True, 3, tp, compiled), symmetric


@pytest.mark.parametrize("tp, compiled, backend", [(2, False, "auto"), (2, True, "auto"), (2, False, "ring"),
                                                   (4, False, "auto"), (4, False, "ring")])
def test_overlapped_tensor_parallelism_equals_the_plain_path_float32(tp, compiled, backend):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    for (plain_losses, plain_grads), (losses, grads), symmetric in run_on_ranks(
            _compare, tp, tp, compiled, backend, backend="nccl", timeout=600):
        assert symmetric == (backend == "auto")   # the fused ops are there on CUDA: no silent fallback
        assert losses == pytest.approx(plain_losses, rel=2e-5)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _carveout_compare():
    """The plain path (whose column linears overlap their input-gradient reduce-scatter with the weight-gradient
    GEMM) without and with ``LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT``; the calls the carve-out made."""
    import os

    from lightning_megatron.tensor_parallel import backward_overlap

    calls = []
    setter = torch._C._set_sm_carveout_experimental

    def recording(value):
        calls.append(value)
        setter(value)

    plain = _train(False, 2, 2, False)
    os.environ[backward_overlap.CARVEOUT_ENV] = "16"
    torch._C._set_sm_carveout_experimental = recording
    try:
        carved = _train(False, 2, 2, False)
    finally:
        torch._C._set_sm_carveout_experimental = setter
        del os.environ[backward_overlap.CARVEOUT_ENV]
    return plain, carved, calls


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_weight_gradient_sm_carveout_changes_no_number():
    for (plain_losses, plain_grads), (losses, grads), calls in run_on_ranks(
            _carveout_compare, 2, backend="nccl", timeout=600):
        # two column linears (qkv, fc1) in each of 4 layers, 2 steps: set to 16 and back each time
        assert calls == [16, None] * (2 * 4 * 2), calls
        assert losses == pytest.approx(plain_losses, rel=1e-6)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _copy_engine_compare():
    """The plain path with NCCL's reduce-scatter and with the copy-engine one (``LIGHTNING_MEGATRON_TP_WGRAD_OVERLAP=
    copy_engine``), eager and compiled; how many reduce-scatters went through symmetric memory."""
    import os

    from lightning_megatron.tensor_parallel import backward_overlap, column_backward

    started = []
    start = column_backward.start_copy_engine_reduce_scatter

    def counting(partial, group):
        started.append(tuple(partial.shape))
        return start(partial, group)

    out = {}
    for compiled in (False, True):
        plain = _train(False, 2, 2, compiled)
        os.environ[backward_overlap.OVERLAP_ENV] = "copy_engine"
        column_backward.start_copy_engine_reduce_scatter = counting
        try:
            copied = _train(False, 2, 2, compiled)
        finally:
            column_backward.start_copy_engine_reduce_scatter = start
            del os.environ[backward_overlap.OVERLAP_ENV]
        out[compiled] = (plain, copied, len(started))
        started.clear()
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_copy_engine_reduce_scatter_equals_nccls():
    for out in run_on_ranks(_copy_engine_compare, 2, backend="nccl", timeout=600):
        for compiled, ((plain_losses, plain_grads), (losses, grads), started) in out.items():
            assert started == 2 * 4 * 2, (compiled, started)   # qkv and fc1 of 4 layers, 2 steps
            assert losses == pytest.approx(plain_losses, rel=2e-5)
            for name, grad in plain_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"compiled={compiled} {name}: {m}")
