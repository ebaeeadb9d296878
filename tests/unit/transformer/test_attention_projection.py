"""Grouped-query attention's projections at tensor-parallel size > 1 run through one column-parallel function (queries,
keys and values from one gathered input), so their input gradient's collective overlaps their weight gradients
(``tensor_parallel/column_backward.py``) as every other column-parallel linear's does: the same numbers as two
linears on one gathered input, float32, at tp2 with and without sequence parallelism and with key/value heads
shared by ranks (tp4, 2 groups); with gradient-accumulation fusion, each weight's gradient accumulated by its own
GEMM (the key/value weight where it is this rank's parameter, not a gathered copy)."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.testing import run_on_ranks


def _run(sequence_parallel, groups, one_linear, fusion):
    """A 2-layer Llama at tp = world: loss, every parameter's gradient (this rank's shards), how many column
    backward calls went through the overlapped path, and how many weight gradients they accumulated by GEMM."""
    from lightning_megatron.models import LlamaModel, llama_config
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel import column_backward
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer.attention import SelfAttention

    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=dist.get_world_size())).activate()
    model_parallel_seed(3)
    config = llama_config(2, 64, 8, num_query_groups=groups, ffn_hidden_size=128, params_dtype=torch.float32,
                          sequence_parallel=sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
                          gradient_accumulation_fusion=fusion)
    model = LlamaModel(config, 128, 32)
    calls, accumulated = [0], [0]
    backward, one_column_linear = column_backward._ColumnParallelLinear.backward, SelfAttention._one_column_linear
    accumulate = column_backward.accumulate_weight_grad

    def counted(ctx, *grads):
        calls[0] += 1
        return backward(ctx, *grads)

    def counted_accumulation(*args):
        accumulated[0] += 1
        return accumulate(*args)

    column_backward._ColumnParallelLinear.backward = staticmethod(counted)
    column_backward.accumulate_weight_grad = counted_accumulation
    if not one_linear:
        SelfAttention._one_column_linear = lambda self: False
    try:
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        loss = model(ids, labels=ids).float().mean()
        loss.backward()
    finally:
        column_backward._ColumnParallelLinear.backward = backward
        column_backward.accumulate_weight_grad = accumulate
        SelfAttention._one_column_linear = one_column_linear
    state.destroy()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls[0], accumulated[0]


def _both(sequence_parallel, groups, fusion):
    return _run(sequence_parallel, groups, True, fusion), _run(sequence_parallel, groups, False, fusion)


@pytest.mark.parametrize("world, sequence_parallel, groups, fusion",
                         [(2, True, 4, False), (2, False, 4, False), (4, True, 2, False), (2, True, 4, True),
                          (4, True, 2, True)],
                         ids=["tp2sp", "tp2", "tp4sp-shared-kv", "tp2sp-fusion", "tp4sp-shared-kv-fusion"])
def test_queries_keys_and_values_as_one_overlapped_column_linear_equal_two_linears(world, sequence_parallel,
                                                                                      groups, fusion):
    for (loss, grads, calls, accumulated), (apart_loss, apart_grads, apart_calls, apart_accumulated) in run_on_ranks(
            _both, world, sequence_parallel, groups, fusion, timeout=300):
        # two layers: fc1 and (q, kv) each through the overlapped column backward; apart: fc1 only
        assert (calls, apart_calls) == (4, 2), (calls, apart_calls)
        # fused: fc1's weight, q's and kv's (unless kv is a gathered, shared copy) accumulated by the column GEMMs
        shared_kv = world > groups
        expected = (2 * (2 if shared_kv else 3), 2) if fusion else (0, 0)
        assert (accumulated, apart_accumulated) == expected, (accumulated, apart_accumulated)
        assert loss == pytest.approx(apart_loss, rel=1e-6)
        assert grads.keys() == apart_grads.keys()
        for name, grad in apart_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
