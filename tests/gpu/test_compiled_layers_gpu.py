"""Compiled layers on a GPU (inductor's Triton kernels): float32 equals eager, bf16 trains as eager bf16 does,
and at tp2 + sp (the NCCL collectives left eager between compiled pieces) with two GPUs."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.testing import run_on_ranks
from helpers.token_steps import adamw_steps

pytestmark = pytest.mark.gpu


def _llama(dtype, **overrides):
    from lightning_megatron.models import LlamaModel, llama_config

    cfg = llama_config(4, 256, 8, num_query_groups=4, ffn_hidden_size=512, params_dtype=dtype, **overrides)
    return LlamaModel(cfg, 1024, 128).cuda()


def _train(compiled, dtype, steps, tp=1, sp=False, dropout=0.0):
    import torch._dynamo

    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer.compile import compile_layers

    torch.cuda.set_device(dist.get_rank())
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=tp)).activate()
    torch._dynamo.reset()
    model_parallel_seed(3)
    model = _llama(dtype, sequence_parallel=sp, hidden_dropout=dropout, attention_dropout=dropout)
    if compiled:
        compile_layers(model)
    losses, grads = adamw_steps(model, steps)
    state.destroy()
    return losses, grads


def _compare(dtype, steps, tp=1, sp=False, dropout=0.0):
    return _train(False, dtype, steps, tp, sp, dropout), _train(True, dtype, steps, tp, sp, dropout)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_float32_equals_eager(dropout):
    (eager_losses, eager_grads), (losses, grads) = run_on_ranks(
        _compare, 1, torch.float32, 3, dropout=dropout, backend="nccl", timeout=600)[0]
    assert losses == pytest.approx(eager_losses, rel=2e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_compiled_bf16_trains_like_eager_bf16():
    """20 AdamW steps: bf16 rounding differs between fused and unfused kernels, the curves must not."""
    (eager_losses, _), (losses, _) = run_on_ranks(_compare, 1, torch.bfloat16, 20, backend="nccl", timeout=600)[0]
    assert losses[-1] < losses[0] - 0.5          # it learns
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) <= 0.02 * b, (losses, eager_losses)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_compiled_tp2_sp_equals_eager_float32():
    for (eager_losses, eager_grads), (losses, grads) in run_on_ranks(
            _compare, 2, torch.float32, 2, tp=2, sp=True, dropout=0.1, backend="nccl", timeout=600):
        assert losses == pytest.approx(eager_losses, rel=2e-5)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _host_copies_in_a_step(built_on_gpu):
    """Copies from the host to the GPU in one profiled step of a compiled model (after two warm-up steps), and where
    the rotary frequencies live; the model moved with ``.cuda()`` or built under ``with torch.device("cuda")``."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer.compile import compile_layers
    from lightning_megatron.transformer.rotary import RotaryEmbedding

    torch.cuda.set_device(0)
    state = ParallelState(ParallelLayout(1)).activate()
    if built_on_gpu:
        from lightning_megatron.models import LlamaModel, llama_config

        with torch.device("cuda"):
            model = LlamaModel(llama_config(4, 256, 8, num_query_groups=4, ffn_hidden_size=512), 1024, 128)
    else:
        model = _llama(torch.float32)
    compile_layers(model)
    ids = torch.randint(0, 1024, (4, 128), device="cuda")

    def step():
        model(ids, labels=ids).float().mean().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    copies = [event.name for event in prof.events() if "HtoD" in event.name]
    devices = {module.inv_freq.device.type for module in model.modules() if isinstance(module, RotaryEmbedding)}
    state.destroy()
    return copies, devices


@pytest.mark.parametrize("built_on_gpu", [False, True])
def test_a_compiled_layer_copies_nothing_from_the_host_per_step(built_on_gpu):
    """The rotary frequencies move to the GPU with the model (``.cuda()``), so the compiled layers do not copy them
    from pageable host memory at every call: such a copy makes the host wait for the GPU's queue, which leaves the
    GPU idle while the host catches up (the TP2 profile's idle gaps)."""
    copies, devices = run_on_ranks(_host_copies_in_a_step, 1, built_on_gpu, backend="nccl", timeout=600)[0]
    assert devices == {"cuda"}
    assert copies == []
