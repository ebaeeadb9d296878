"""Expert rows in 16-aligned groups (what float8 grouped GEMMs need): the layout, and that GroupedMLP's
aligned path gives the unaligned experts' outputs and gradients, with any counts, sync-free shapes."""

import pytest
import torch

from lightning_megatron.moe import GroupedMLP
from lightning_megatron.moe.aligned_groups import align_groups, aligned_capacity


class LoopGroupedMM:
    """A reference grouped GEMM that insists on aligned groups, as ``torch._scaled_grouped_mm`` does."""
    alignment = 16

    def __init__(self):
        self.calls = 0

    def __call__(self, a, b_t, offsets):
        self.calls += 1
        ends = offsets.tolist()
        assert all(end % self.alignment == 0 for end in ends), ends
        assert ends[-1] == a.shape[0] and len(ends) == b_t.shape[0]
        starts = [0] + ends[:-1]
        return torch.cat([a[s:e] @ b_t[g] for g, (s, e) in enumerate(zip(starts, ends))])


COUNTS = {"uneven": [5, 0, 17, 16, 1, 33, 0, 8], "one-expert-takes-all": [0, 0, 80, 0, 0, 0, 0, 0],
          "aligned": [16, 32, 0, 16, 16, 0, 0, 0], "empty-last": [40, 3, 0, 0, 0, 0, 0, 0]}


@pytest.mark.parametrize("name", list(COUNTS))
def test_layout_puts_each_group_on_aligned_rows(name):
    counts = torch.tensor(COUNTS[name])
    x = torch.randn(int(counts.sum()), 4)
    aligned, rows, offsets = align_groups(x, counts, 16)
    assert aligned.shape[0] == aligned_capacity(x.shape[0], len(counts), 16) and aligned.shape[0] % 16 == 0
    assert offsets.dtype == torch.int32 and offsets[-1] == aligned.shape[0]
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    packed = 0
    for g, count in enumerate(counts.tolist()):
        assert starts[g] % 16 == 0 and ends[g] - starts[g] >= count
        assert torch.equal(aligned[starts[g]:starts[g] + count], x[packed:packed + count])
        assert not aligned[starts[g] + count:ends[g]].any()          # the rest of the group is zero rows
        assert torch.equal(rows[packed:packed + count], torch.arange(starts[g], starts[g] + count))
        packed += count
    assert torch.equal(aligned[rows], x)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("name", list(COUNTS))
def test_aligned_experts_equal_the_unaligned_ones(name, activation):
    torch.manual_seed(0)
    counts = torch.tensor(COUNTS[name])
    mlp = GroupedMLP(len(counts), 32, 48, activation=activation, params_dtype=torch.float64, backend="loop")
    x = torch.randn(int(counts.sum()), 32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(x.shape[0], 32, dtype=torch.float64)

    def run():
        out = mlp(x, counts)
        out.backward(grad)
        grads = [t.grad.clone() for t in (x, mlp.weight1, mlp.weight2)]
        x.grad = mlp.weight1.grad = mlp.weight2.grad = None
        return out.detach(), grads

    reference, reference_grads = run()
    mlp.float8 = LoopGroupedMM()
    out, grads = run()
    assert mlp.float8.calls == 2   # both projections went through the aligned grouped GEMM
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_static_capacity_rows_take_the_aligned_path_too():
    torch.manual_seed(0)
    mlp = GroupedMLP(4, 32, 48, params_dtype=torch.float64, backend="bmm")
    x = torch.randn(4 * 6, 32, dtype=torch.float64)
    reference = mlp(x, torch.full((4,), 6), rows_per_expert=6)
    mlp.float8 = LoopGroupedMM()
    torch.testing.assert_close(mlp(x, torch.full((4,), 6), rows_per_expert=6), reference, rtol=1e-12, atol=1e-12)
