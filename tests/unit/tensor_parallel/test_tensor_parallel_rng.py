"""Model-parallel RNG (seed 002 appendix B.2) and checkpointing that recomputes bit-identically."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear, RNGStatesTracker, RowParallelLinear, checkpoint, get_rng_tracker, model_parallel_seed,
)
from lightning_megatron.testing import run_on_ranks
from helpers.tp_utils import gather, tp_state


def _dropout_masks():
    state = tp_state()
    model_parallel_seed(1234)
    x = torch.ones(64, 32)
    outside = F.dropout(x, p=0.5)                   # replicated region: default generator
    with get_rng_tracker().fork():
        inside = F.dropout(x, p=0.5)                # this rank's heads: tracker generator
    outside_all = gather(outside.unsqueeze(0), 0, state)
    inside_all = gather(inside.unsqueeze(0), 0, state)
    same_outside = all(torch.equal(outside_all[0], o) for o in outside_all)
    distinct_inside = all(not torch.equal(inside_all[i], inside_all[j])
                          for i in range(len(inside_all)) for j in range(i))
    # the fork leaves the default stream exactly where it would be without it
    model_parallel_seed(1234)
    F.dropout(x, p=0.5)
    with get_rng_tracker().fork():
        pass
    again = F.dropout(x, p=0.5)
    model_parallel_seed(1234)
    F.dropout(x, p=0.5)
    plain = F.dropout(x, p=0.5)
    return same_outside, distinct_inside, torch.equal(again, plain)


@pytest.mark.parametrize("world", [2, 4])
def test_dropout_same_outside_tp_regions_different_inside(world):
    assert run_on_ranks(_dropout_masks, world, timeout=60) == [(True, True, True)] * world


def test_tracker_rejects_duplicates_and_unknown_names():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used by RNG state 'a'"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("missing"):
            pass
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)


H = 16


def _block(fc1, fc2, x):
    with get_rng_tracker().fork():
        h = F.dropout(F.gelu(fc1(x)), p=0.3)        # inside the tp region
    return F.dropout(fc2(h), p=0.3) + x              # outside: after the row-parallel reduce


def _checkpointed_equals_plain():
    tp_state()
    model_parallel_seed(7)
    fc1 = ColumnParallelLinear(H, 4 * H)
    fc2 = RowParallelLinear(4 * H, H, input_is_parallel=True)
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(3))
    results = []
    for use_checkpoint in (False, True):
        model_parallel_seed(99)
        inp = x.clone().requires_grad_()
        out = checkpoint(_block, fc1, fc2, inp) if use_checkpoint else _block(fc1, fc2, inp)
        # draw after the forward: recomputation in backward must not shift these streams
        after = (torch.rand(4), _fork_draw())
        out.square().sum().backward()
        grads = [inp.grad.clone()] + [p.grad.clone() for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
        for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias):
            p.grad = None
        results.append((out.detach(), grads, after, (torch.rand(4), _fork_draw())))
    (out0, grads0, after0, end0), (out1, grads1, after1, end1) = results
    return (torch.equal(out0, out1), all(torch.equal(a, b) for a, b in zip(grads0, grads1)),
            all(torch.equal(a, b) for a, b in zip(after0 + end0, after1 + end1)))


def _fork_draw():
    with get_rng_tracker().fork():
        return torch.rand(4)


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointed_block_recomputes_identically(world):
    assert run_on_ranks(_checkpointed_equals_plain, world, timeout=60) == [(True, True, True)] * world
