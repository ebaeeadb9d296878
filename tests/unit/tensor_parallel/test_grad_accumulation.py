"""Weight gradients accumulated by their GEMMs (``tensor_parallel/grad_accumulation.py``): in place in ``.grad``
or ``main_grad``, equal to autograd's sum, the post-accumulate hooks called once per product (so overlapped
data-parallel buckets are issued inside the last backward), traced into compiled graphs without a break."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.testing import run_on_ranks

WIDTH, MICRO_BATCHES = 8, 3


def _stack(fused, dtype=torch.float32):
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        layers += [ColumnParallelLinear(WIDTH, 2 * WIDTH, bias=True, params_dtype=dtype,
                                        grad_accumulation_fusion=fused),
                   nn.GELU(),
                   RowParallelLinear(2 * WIDTH, WIDTH, bias=False, input_is_parallel=True, params_dtype=dtype,
                                     grad_accumulation_fusion=fused)]
    return nn.Sequential(*layers)


def _batch(rank, micro_batch, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 * rank + micro_batch)
    return torch.randn(2, 4, WIDTH, generator=gen).to(dtype)


def _dot_grads(fused, compile_backend=None, autocast=False):
    """``.grad`` after three micro-batches, whether each weight's ``.grad`` stayed one tensor, and hook calls."""
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    state = ParallelState(ParallelLayout(1)).activate()
    torch._dynamo.reset()
    model = _stack(fused)
    calls = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    first = {}
    for mb in range(MICRO_BATCHES):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            run(_batch(0, mb)).float().square().sum().backward()
        if mb == 0:
            first = {name: p.grad for name, p in model.named_parameters()}
    same = {name: p.grad is first[name] for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    state.destroy()
    return grads, same, calls


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_fused_accumulation_equals_autograd_in_place(backend):
    reference, _, _ = run_on_ranks(_dot_grads, 1, False, timeout=200)[0]
    grads, same, calls = run_on_ranks(_dot_grads, 1, True, backend, timeout=400)[0]
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    weights = [name for name in reference if name.endswith("weight")]
    assert weights and all(same[name] for name in weights), same        # accumulated into one tensor in place
    for name in weights:   # once per micro-batch (compiled: the graph's own edge calls them once more, gradless)
        assert calls[name] == MICRO_BATCHES * (1 if backend is None else 2), (name, calls)


def test_fused_accumulation_under_autocast_equals_autograd():
    """float32 parameters, bf16 products: the product is formed and added (no dtype-mixing GEMM on the CPU)."""
    reference, _, _ = run_on_ranks(_dot_grads, 1, False, None, True, timeout=200)[0]
    grads, _, _ = run_on_ranks(_dot_grads, 1, True, None, True, timeout=200)[0]
    for name, grad in reference.items():
        assert grads[name].dtype == torch.float32
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _buckets_with_fused_weights(fused, compile_backend):
    """Data-parallel buffers with overlapped reduction: when each bucket was issued, and the reduced gradients."""
    from lightning_megatron.distributed import DataParallelGrads
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    rank, world = dist.get_rank(), dist.get_world_size()
    state = ParallelState(ParallelLayout(world)).activate()
    torch._dynamo.reset()
    model = _stack(fused)
    grads = DataParallelGrads(list(model.parameters()), dense_group=dist.group.WORLD, divisor=world,
                              overlap_grad_reduce=True, bucket_size=2 * WIDTH * WIDTH)
    events = []
    issue = grads._issue

    def record_issue(buffer, bucket):
        if not bucket.started:
            events.append("issue")
        issue(buffer, bucket)

    grads._issue = record_issue
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    for mb in range(MICRO_BATCHES):
        if mb < MICRO_BATCHES - 1:
            with grads.no_sync():
                run(_batch(rank, mb)).square().sum().backward()
        else:
            run(_batch(rank, mb)).square().sum().backward()
        events.append(f"backward {mb} done")
    grads.finish_grad_sync()
    reduced = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    buckets = len(grads.buffers[0].buckets)
    state.destroy()
    return events, reduced, buckets


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_fused_weights_issue_their_buckets_inside_the_last_backward(backend):
    plain = run_on_ranks(_buckets_with_fused_weights, 2, False, None, timeout=300)
    fused = run_on_ranks(_buckets_with_fused_weights, 2, True, backend, timeout=300)
    for (events, reduced, buckets), (_, want, _) in zip(fused, plain):
        for name, grad in want.items():
            torch.testing.assert_close(reduced[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert buckets > 2
        last = events.index(f"backward {MICRO_BATCHES - 1} done")
        # every bucket issued from the hooks while the last backward ran, none during the no_sync micro-batches
        assert events[last - buckets:last] == ["issue"] * buckets, events
        assert events.count("issue") == buckets, events
