"""Pipeline executors: every layout gives the single-stage loss and gradients; memory stays bounded.

The model (tests/helpers/pp_utils.py) is an embedding, 8 residual Linear-tanh blocks and an output layer
tied to the embedding; every layout builds the same numbers, so PP/VPP/TP runs must reproduce
the pp=1 run (the executor's no-pipelining path, in this process) to float32 round-off.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline import (
    allreduce_shared_embedding_grads, deallocate_output_tensor, forward_backward,
    sync_shared_embedding_weights,
)
from lightning_megatron.testing import run_on_ranks
from helpers.pp_utils import (
    B, H, NUM_LAYERS, S, Chunk, build_chunks, forward_step, full_grads, microbatches, num_tokens,
    reference,
)

TOL = dict(atol=1e-5, rtol=1e-5)


def _state(tp=1, pp=1, vp=None):
    return ParallelState(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp),
                         virtual_pipeline_size=vp).activate()


# --- every layout equals the single-stage run ----------------------------------------------------


def _pipelined(tp, pp, vp, m, mode, data):
    state = _state(tp, pp, vp)
    per_token, varlen = mode == "per_token", mode == "varlen"
    chunks = build_chunks(state, vp, tp=tp > 1, per_token=per_token)
    sync_shared_embedding_weights(chunks)  # the last stage's output weight started at zero
    mbs = microbatches(m, varlen=varlen, per_token=per_token)
    edge = state.is_pipeline_first_stage(ignore_virtual=True) or state.is_pipeline_last_stage(
        ignore_virtual=True)
    source = {"list": mbs, "iterator": iter(mbs), "edges_only": mbs if edge else None}[data]
    out = forward_backward(
        forward_step, source, chunks, num_microbatches=m, tensor_shape=(S, B, H),
        variable_seq_lengths=varlen, num_tokens=num_tokens(mbs) if per_token else None,
        finalize_grads=lambda: allreduce_shared_embedding_grads(chunks))
    return out.loss, full_grads(chunks, state), [l["tokens"] for l in out.logged]


LAYOUTS = [  # world, tp, pp, vp, micro-batches, loss mode, how this rank gets its data
    pytest.param(2, 1, 2, None, 8, "mean", "list", id="pp2"),
    pytest.param(2, 1, 2, 2, 8, "mean", "iterator", id="pp2-vp2-iterator"),
    pytest.param(4, 1, 4, None, 8, "mean", "edges_only", id="pp4-data-on-edges-only"),
    pytest.param(4, 1, 4, 2, 8, "mean", "list", id="pp4-vp2"),
    pytest.param(4, 2, 2, None, 4, "mean", "list", id="tp2-pp2"),
    pytest.param(4, 2, 2, 2, 4, "mean", "list", id="tp2-pp2-vp2"),
    pytest.param(2, 1, 2, 2, 6, "varlen", "list", id="pp2-vp2-variable-seq-lengths"),
    pytest.param(4, 1, 4, None, 5, "per_token", "list", id="pp4-per-token-loss"),
]


@pytest.mark.parametrize("world, tp, pp, vp, m, mode, data", LAYOUTS)
def test_pipelined_equals_single_stage(world, tp, pp, vp, m, mode, data):
    ref_loss, ref_grads = reference(m, varlen=mode == "varlen", per_token=mode == "per_token")
    results = run_on_ranks(_pipelined, world, tp, pp, vp, m, mode, data, timeout=60)
    seen = set()
    for rank, (loss, grads, tokens) in enumerate(results):
        last = (rank // tp) % pp == pp - 1  # pp is the slowest axis here (dp = 1)
        assert (loss is not None) == last, rank
        if last:
            torch.testing.assert_close(loss, ref_loss, **TOL)
            assert len(tokens) == m
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=f"rank {rank}: {name}")
        seen |= set(grads)
    assert seen == set(ref_grads)  # every layer, and the tied embedding on both ends


# --- forward-only --------------------------------------------------------------------------------


def _forward_only_vs_training():
    state = _state(pp=2, vp=2)
    chunks = build_chunks(state, 2)
    sync_shared_embedding_weights(chunks)
    mbs = microbatches(4)
    evaluated = forward_backward(forward_step, mbs, chunks, tensor_shape=(S, B, H),
                                 forward_only=True)
    no_grads = all(p.grad is None for c in chunks for p in c.parameters())
    trained = forward_backward(forward_step, mbs, chunks, tensor_shape=(S, B, H))
    return evaluated, trained, no_grads


def test_forward_only_returns_training_losses_without_backward():
    for evaluated, trained, no_grads in run_on_ranks(_forward_only_vs_training, 2, timeout=60):
        assert no_grads
        assert len(evaluated.losses) == len(trained.losses)
        for a, b in zip(evaluated.losses, trained.losses):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        if trained.loss is not None:
            torch.testing.assert_close(evaluated.loss, trained.loss, atol=0, rtol=0)
    ref_loss, _ = reference(4)
    chunk = Chunk(range(NUM_LAYERS), True, True)
    single = forward_backward(forward_step, microbatches(4), chunk, forward_only=True)
    torch.testing.assert_close(single.loss, ref_loss, atol=0, rtol=0)
    assert all(p.grad is None for p in chunk.parameters())


# --- memory -------------------------------------------------------------------------------


class SavedActivations:
    """Live bytes of tensors autograd saved for backward (parameters excluded), and their peak."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def pack(self, tensor):
        if tensor.untyped_storage().data_ptr() in self.param_storages:
            return tensor
        return _Held(self, tensor)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, tracker, tensor):
        self.tracker, self.tensor = tracker, tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        tracker.live += self.nbytes
        tracker.peak = max(tracker.peak, tracker.live)

    def __del__(self):
        self.tracker.live -= self.nbytes


def _peak_saved_bytes(chunks, m, pp_group=None):
    tracker, sent = SavedActivations([p for c in chunks for p in c.parameters()]), []

    def step(mb, chunk, ctx):
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            out = chunk(mb, ctx.input_tensor)
        if not ctx.is_last_stage:
            sent.append(out)
        return out

    forward_backward(step, microbatches(m), chunks, tensor_shape=(S, B, H), pp_group=pp_group)
    freed = all(o.untyped_storage().nbytes() == o.element_size() for o in sent)
    return tracker.peak, tracker.live, freed


def _activation_peaks():
    state = _state(pp=2)
    chunks = build_chunks(state)
    return {m: _peak_saved_bytes(chunks, m) for m in (4, 16)}


def test_1f1b_activation_memory_does_not_grow_with_microbatches():
    for rank, peaks in enumerate(run_on_ranks(_activation_peaks, 2, timeout=60)):
        (peak4, live4, freed4), (peak16, live16, freed16) = peaks[4], peaks[16]
        assert peak4 > 0 and peak4 == peak16, (rank, peaks)
        assert live4 == live16 == 0  # every graph was freed by its backward
        assert freed4 and freed16    # outputs sent to the next stage kept no storage
    chunk = [Chunk(range(NUM_LAYERS), True, True)]  # no pipelining: one micro-batch at a time
    assert _peak_saved_bytes(chunk, 4)[0] == _peak_saved_bytes(chunk, 16)[0] > 0


def test_deallocate_output_tensor_keeps_backward_exact():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    grad = torch.randn(4, 5)
    (x @ w + 1).backward(grad)
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    out = x @ w + 1
    deallocate_output_tensor(out)
    assert out.shape == (4, 5) and out.untyped_storage().nbytes() == out.element_size()
    torch.autograd.backward(out, grad)
    torch.testing.assert_close((x.grad, w.grad), expected, atol=0, rtol=0)
    view = (x @ w)[1:]
    deallocate_output_tensor(view)  # views share their base's storage: left alone
    assert view.untyped_storage().nbytes() == 4 * 5 * 4


# --- no pipelining: gradient accumulation ------------------------------------------------------


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_accumulation_equals_one_big_batch(per_token):
    events = []

    class NoSync:
        def __enter__(self):
            events.append("no_sync")

        def __exit__(self, *exc):
            events.append("sync")

    def step(mb, chunk, ctx):
        events.append(f"mb{ctx.microbatch_id}")
        return forward_step(mb, chunk, ctx)

    mbs = microbatches(4, per_token=per_token)
    chunk = Chunk(range(NUM_LAYERS), True, True, per_token=per_token)
    out = forward_backward(step, mbs, chunk, no_sync=NoSync,
                           num_tokens=num_tokens(mbs) if per_token else None,
                           finalize_grads=lambda: events.append("finalize"))
    assert events == ["no_sync", "mb0", "mb1", "mb2", "sync", "mb3", "finalize"]
    big = {k: torch.cat([mb[k] for mb in mbs], dim=1) for k in ("ids", "labels")}
    whole = Chunk(range(NUM_LAYERS), True, True, per_token=per_token)
    loss, _ = whole(big)
    if per_token:
        loss = loss / num_tokens(mbs)
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), **TOL)
    for (name, p), q in zip(chunk.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


# --- argument errors ----------------------------------------------------------------------


def test_errors_name_the_argument():
    chunk = Chunk(range(NUM_LAYERS), True, True)
    mbs = microbatches(2)
    with pytest.raises(ValueError, match="pp_size=1"):
        forward_backward(forward_step, mbs, [chunk, chunk])
    with pytest.raises(ValueError, match="num_microbatches is required"):
        forward_backward(forward_step, iter(mbs), chunk)
    with pytest.raises(ValueError, match="num_microbatches=3 but 2"):
        forward_backward(forward_step, mbs, chunk, num_microbatches=3)
    with pytest.raises(ValueError, match="ran out after 2"):
        forward_backward(forward_step, iter(mbs), chunk, num_microbatches=3)
    with pytest.raises(ValueError, match="scalar"):
        forward_backward(lambda mb, c, ctx: torch.ones(2, requires_grad=True), mbs, chunk)
    with pytest.raises(TypeError, match=r"\(loss, logged\)"):
        forward_backward(lambda mb, c, ctx: "nope", mbs, chunk)


def _mismatched_tied_embeddings():
    state = _state(pp=2)
    chunks = build_chunks(state)
    if state.pp_rank == 1:
        chunks[0].head.shared_embedding = False  # the last stage forgot to mark its copy
    with pytest.raises(ValueError, match="shared_embedding=True"):
        sync_shared_embedding_weights(chunks)
    return True


def test_tied_embedding_mismatch_is_reported_on_every_rank():
    assert run_on_ranks(_mismatched_tied_embeddings, 2, timeout=60) == [True, True]

