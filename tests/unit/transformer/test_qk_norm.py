"""AcrossHeadsRMSNorm (OLMo-2's q/k norm over all heads) equals Hugging Face's Olmo2RMSNorm on one rank, and its
tensor-parallel split equals the one-rank norm: outputs, input gradients and the tp-summed weight gradient."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.tensor_parallel.utils import allreduce_sequence_parallel_grads
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer.qk_norm import AcrossHeadsRMSNorm

B, S, D, EPS = 2, 5, 4, 1e-6
TOL = dict(rtol=1e-5, atol=1e-6)
# (name, tp size, heads, ranks per head): queries split evenly; 2 key/value heads at tp 2, replicated at tp 4
CASES = [("q-tp2", 2, 8, 1), ("q-tp4", 4, 8, 1), ("kv-tp2", 2, 2, 1), ("kv-tp4-shared", 4, 2, 2)]


def data(heads, tp, sharing, seed):
    """Global input ``[B, heads, S, D]``, a random weight, and each tp rank's own upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, heads, S, D, generator=gen) * 3
    weight = torch.rand(heads * D, generator=gen) + 0.5
    local = heads * sharing // tp
    upstream = [torch.randn(B, local, S, D, generator=gen) for _ in range(tp)]
    return x, weight, upstream


def to_hf(x):
    """``[b, heads, s, d]`` -> HF's ``[b, s, heads * d]``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


def from_hf(y, heads):
    return y.view(y.shape[0], y.shape[1], heads, -1).transpose(1, 2)


def first_head(rank, heads, tp, sharing):
    return rank // sharing * (heads * sharing // tp)


def reference(heads, tp, sharing, seed):
    """The one-rank norm on the whole tensor: the loss is the sum over ranks of (output * own upstream), so a head
    that ``sharing`` ranks hold gets the sum of their upstream gradients."""
    x, weight, upstream = data(heads, tp, sharing, seed)
    full = torch.zeros_like(x)
    local = heads * sharing // tp
    for rank, grad in enumerate(upstream):
        first = first_head(rank, heads, tp, sharing)
        full[:, first:first + local] += grad
    norm = AcrossHeadsRMSNorm(heads, D, EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    x.requires_grad_()
    out = norm(x, 0, None)
    (out * full).sum().backward()
    return out.detach(), x.grad, norm.weight.grad


def _tp_worker():
    """World of 4: tp 4 over the world, and tp 2 over {0, 1} and {2, 3} (two replicas with different data)."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for name, tp, heads, sharing in CASES:
        group = dist.group.WORLD if tp == 4 else pairs[rank // 2]
        replica = 0 if tp == 4 else rank // 2
        tp_rank = dist.get_rank(group)
        x, weight, upstream = data(heads, tp, sharing, seed=replica)
        local = heads * sharing // tp
        first = first_head(tp_rank, heads, tp, sharing)
        norm = AcrossHeadsRMSNorm(heads, D, EPS)
        with torch.no_grad():
            norm.weight.copy_(weight)
        mine = x[:, first:first + local].clone().requires_grad_()
        out = norm(mine, first, group, sharing)
        (out * upstream[tp_rank]).sum().backward()
        allreduce_sequence_parallel_grads(norm.parameters(), group)   # the project's gradient finalisation
        results[name] = (replica, tp_rank, out.detach(), mine.grad, norm.weight.grad)
    return results


@pytest.fixture(scope="module")
def tp_results():
    return run_on_ranks(_tp_worker, 4, timeout=120)


def test_one_rank_equals_olmo2_rmsnorm():
    """Forward, input and weight gradients equal transformers' Olmo2RMSNorm on the full width."""
    modeling = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    heads = 6
    x, weight, _ = data(heads, 1, 1, seed=3)
    upstream = torch.randn(B, heads, S, D)
    hf = modeling.Olmo2RMSNorm(heads * D, eps=EPS)
    norm = AcrossHeadsRMSNorm(heads, D, EPS)
    with torch.no_grad():
        hf.weight.copy_(weight)
        norm.weight.copy_(weight)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = from_hf(hf(to_hf(x_hf)), heads)
    got = norm(x_ours, 0, None)
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, **TOL)
    torch.testing.assert_close(norm.weight.grad, hf.weight.grad, **TOL)
    assert norm.weight.sequence_parallel   # summed over tp by the gradient finalisation


def test_one_rank_bfloat16_casts_like_olmo2_rmsnorm():
    """bf16 input: normalised and scaled in float32, then cast once, as HF does. Only the order of the sum of squares
    differs, which may flip a rare rounding; casting before the weight multiply changes ~20% of the elements."""
    modeling = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    heads = 4
    x, weight, _ = data(heads, 1, 1, seed=4)
    hf = modeling.Olmo2RMSNorm(heads * D, eps=EPS)
    norm = AcrossHeadsRMSNorm(heads, D, EPS)
    with torch.no_grad():
        hf.weight.copy_(weight)
        norm.weight.copy_(weight)
    x = x.bfloat16()
    got, want = norm(x, 0, None), from_hf(hf(to_hf(x)), heads)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() <= 0.01
    torch.testing.assert_close(got, want, rtol=2 ** -8, atol=0.0)   # one bf16 ulp at most


def test_zero_centered_scales_by_one_plus_weight():
    heads = 3
    norm = AcrossHeadsRMSNorm(heads, D, EPS, zero_centered=True)
    assert torch.equal(norm.weight, torch.zeros(heads * D))
    x, weight, _ = data(heads, 1, 1, seed=5)
    with torch.no_grad():
        norm.weight.copy_(weight - 1.0)
    flat = to_hf(x)
    want = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + norm.weight.detach())
    torch.testing.assert_close(norm(x, 0, None), from_hf(want, heads), **TOL)


def test_rejects_heads_outside_the_weight():
    norm = AcrossHeadsRMSNorm(4, D, EPS)
    with pytest.raises(ValueError, match="not among"):
        norm(torch.randn(B, 2, S, D), 3, None)
    with pytest.raises(ValueError, match="not among"):
        norm(torch.randn(B, 2, S, D), -1, None)
    with pytest.raises(ValueError, match="expected x of shape"):
        norm(torch.randn(B, 4, S, D + 1), 0, None)
    with pytest.raises(ValueError, match="expected x of shape"):
        norm(torch.randn(B, 4 * S, D), 0, None)
    with pytest.raises(ValueError, match="cover"):   # without a group, this rank must hold every head
        norm(torch.randn(B, 2, S, D), 0, None)
    with pytest.raises(ValueError, match="cover"):
        norm(torch.randn(B, 4, S, D), 0, None, sharing=2)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tensor_parallel_equals_one_rank(tp_results, case):
    """Every rank's output is its slice of the one-rank output; input gradients summed over the ranks that share a
    head, and the tp-summed weight gradient, equal the one-rank gradients."""
    name, tp, heads, sharing = case
    local = heads * sharing // tp
    for replica in {r[name][0] for r in tp_results}:
        ranks = sorted((r[name] for r in tp_results if r[name][0] == replica), key=lambda r: r[1])
        assert len(ranks) == tp
        out, x_grad, w_grad = reference(heads, tp, sharing, seed=replica)
        summed = torch.zeros_like(x_grad)
        for _, tp_rank, got, got_x_grad, got_w_grad in ranks:
            first = first_head(tp_rank, heads, tp, sharing)
            torch.testing.assert_close(got, out[:, first:first + local], **TOL)
            summed[:, first:first + local] += got_x_grad
            torch.testing.assert_close(got_w_grad, w_grad, **TOL)
        torch.testing.assert_close(summed, x_grad, **TOL)
