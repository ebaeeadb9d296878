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
