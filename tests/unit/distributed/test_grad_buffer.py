"""Gradient buffers: layout in backward order, accumulation into ``main_grad``, reduction once per step,
early buckets issued while the backward still runs (overlap), float32 reduction of bf16 gradients."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.distributed import DataParallelGrads, bucket_layout
from lightning_megatron.distributed.grad_buffer import SHARD_ALIGN
from lightning_megatron.testing import run_on_ranks

WIDTH, DEPTH = 8, 6   # six 8x8 linear layers: 72 elements each


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(dtype)


def _batch(rank, microbatch, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 * rank + microbatch)
    return torch.randn(4, WIDTH, generator=gen).to(dtype)


# -- layout (pure) --------------------------------------------------------------------------------


def test_bucket_layout_closes_buckets_at_parameter_boundaries():
    ranges, buckets, total = bucket_layout([10, 5, 7, 3], bucket_size=12)
    assert ranges == [(0, 10), (10, 15), (15, 22), (22, 25)]
    assert [(b.start, b.end, b.params) for b in buckets] == [(0, 15, (0, 1)), (15, 25, (2, 3))]
    assert total == 25
    _, one, _ = bucket_layout([10, 5, 7, 3], bucket_size=None)
    assert [(b.start, b.end) for b in one] == [(0, 25)]


def test_bucket_layout_pads_for_sharding_and_isolates():
    ranges, buckets, total = bucket_layout([10, 5, 7, 3], bucket_size=None, pad_to=8,
                                           isolate=[False, True, False, False])
    assert [(b.start, b.end, b.params, b.isolated) for b in buckets] == [
        (0, 8 * 2, (0,), False), (16, 24, (1,), True), (24, 40, (2, 3), False)]
    assert ranges[1] == (16, 21) and total == 40
    assert all((b.end - b.start) % 8 == 0 for b in buckets)
    with pytest.raises(ValueError, match="bucket_size must be a positive"):
        bucket_layout([3], bucket_size=0)


def test_buffer_is_in_backward_order_and_grads_view_into_it():
    model = _mlp()
    grads = DataParallelGrads(list(model.parameters()), dense_group=None, bucket_size=WIDTH * WIDTH + WIDTH)
    (buffer,) = grads.buffers
    params = list(model.parameters())
    assert buffer.params == params[::-1]                       # last layer first
    assert len(buffer.buckets) == DEPTH and buffer.buckets[0].params == params[-2:][::-1]
    for param in params:
        assert param.main_grad.data_ptr() >= buffer.data.data_ptr()
    model(_batch(0, 0)).sum().backward()
    assert all(p.grad is None for p in params)                 # moved into main_grad by the hook
    grads.attach()
    assert all(p.grad.data_ptr() == p.main_grad.data_ptr() for p in params)
    grads.detach()
    grads.close()


def test_micro_batches_accumulate_and_zero_grad_restarts():
    model, reference = _mlp(), _mlp()
    grads = DataParallelGrads(list(model.parameters()), dense_group=None)
    for mb in range(3):
        model(_batch(0, mb)).sum().backward()
        reference(_batch(0, mb)).sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=0, atol=1e-6)
    grads.zero_grad()
    assert all(float(p.main_grad.abs().sum()) == 0 for p in model.parameters())


def test_grad_reduce_in_fp32_accumulates_bf16_gradients_in_float32():
    model = _mlp(torch.bfloat16)
    grads = DataParallelGrads(list(model.parameters()), dense_group=None, grad_reduce_in_fp32=True)
    assert grads.buffers[0].data.dtype == torch.float32
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    probe = _mlp(torch.bfloat16)
    for mb in range(4):
        model(_batch(0, mb, torch.bfloat16)).sum().backward()
        probe.zero_grad()
        probe(_batch(0, mb, torch.bfloat16)).sum().backward()
        for acc, p in zip(expected, probe.parameters()):
            acc += p.grad.float()
    for param, acc in zip(model.parameters(), expected):
        assert torch.equal(param.main_grad, acc)               # float32 sums of the bf16 micro-batch grads
    grads.attach()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


# -- on two gloo ranks ----------------------------------------------------------------------------


def _reduce_on_two_ranks(overlap, shard, microbatches=3):
    """Grads reduced by the buffers vs. by hand, and the order of events in the last backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    grads = DataParallelGrads(list(model.parameters()), dense_group=dist.group.WORLD, divisor=world,
                              overlap_grad_reduce=overlap, bucket_size=WIDTH * WIDTH + WIDTH, shard=shard)
    events = []
    issue = grads._issue

    def record_issue(buffer, bucket):
        if not bucket.started:
            events.append(f"issue {bucket.index}")
        issue(buffer, bucket)

    grads._issue = record_issue
    first_weight = model[0].weight                              # the last gradient of the backward
    first_weight.register_post_accumulate_grad_hook(lambda p: events.append("first layer grad"))
    for mb in range(microbatches):
        last = mb == microbatches - 1
        if not last:
            with grads.no_sync():
                model(_batch(rank, mb)).sum().backward()
        else:
            model(_batch(rank, mb)).sum().backward()
        events.append(f"backward {mb} done")
    grads.finish_grad_sync()
    events.append("finished")

    reference = _mlp()
    for mb in range(microbatches):
        reference(_batch(rank, mb)).sum().backward()
    mismatch = 0.0
    for param, ref in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(ref.grad)
        ref.grad /= world
        buffer = grads.buffers[0]
        start, end = buffer.ranges[id(param)]
        lo, hi = buffer.shard_range(buffer.bucket_of[id(param)])
        a, b = max(start, lo), min(end, hi)   # what this rank holds reduced (all of it unsharded)
        if a < b:
            got, want = buffer.data[a:b], ref.grad.reshape(-1)[a - start:b - start]
            mismatch = max(mismatch, float((got - want).abs().max()))
    return {"events": events, "mismatch": mismatch, "buckets": len(grads.buffers[0].buckets),
            "padded": all((b.end - b.start) % (world * SHARD_ALIGN) == 0 for b in grads.buffers[0].buckets)}


def _all_modes():
    return {(overlap, shard): _reduce_on_two_ranks(overlap, shard) for overlap in (False, True)
            for shard in (False, True)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_all_modes, 2, timeout=120)


@pytest.mark.parametrize("shard", [False, True])
def test_overlap_issues_early_buckets_before_the_backward_finishes(two_ranks, shard):
    for rank_out in two_ranks:
        out = rank_out[(True, shard)]
        events = out["events"]
        assert out["mismatch"] < 1e-6
        issued = [e for e in events if e.startswith("issue")]
        assert issued == [f"issue {i}" for i in range(out["buckets"])]     # each bucket once, in backward order
        last_backward = events.index("first layer grad", events.index("backward 1 done"))
        # every bucket but the first layer's own is issued inside the last backward, before it ends
        assert events.index("issue 0") < last_backward < events.index("backward 2 done")
        assert events.index(f"issue {out['buckets'] - 2}") < last_backward
        assert events.index("backward 1 done") < events.index("issue 0")  # nothing during no_sync micro-batches


@pytest.mark.parametrize("shard", [False, True])
def test_without_overlap_everything_is_reduced_after_the_schedule(two_ranks, shard):
    for rank_out in two_ranks:
        out = rank_out[(False, shard)]
        events = out["events"]
        assert out["mismatch"] < 1e-6
        assert min(events.index(e) for e in events if e.startswith("issue")) > events.index("backward 2 done")
        assert out["padded"] or not shard
