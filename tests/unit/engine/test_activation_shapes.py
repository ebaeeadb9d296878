"""Pipeline stages learn the activation shape from one step with shape headers, then exchange without them (no host
synchronisation per exchange): the updates stay bit for bit those of exchanging headers every time, micro-batches of
another shape are learned in turn, and ``LIGHTNING_MEGATRON_PIPELINE_SHAPES=exchange`` keeps the headers."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.distributed.config import GradientConfig
from lightning_megatron.distributed.gradients import GradientState
from lightning_megatron.engine import StepEngine
from lightning_megatron.engine.activation_shapes import ENV, learning_enabled, one_shape, signature
from lightning_megatron.engine.train_step import TrainStep
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline.p2p import PipelineP2P
from lightning_megatron.testing import run_on_ranks
from helpers.engine_utils import TinyLM
from helpers.strategy_utils import VOCAB, full_parameters

SEQ = 16


@contextlib.contextmanager
def counting_headers(headers):
    """Count each shape-header exchange into ``headers[-1]`` while inside."""
    original = PipelineP2P._exchange_shapes

    def counting(self, *args):
        headers[-1] += 1
        return original(self, *args)

    PipelineP2P._exchange_shapes = counting
    try:
        yield
    finally:
        PipelineP2P._exchange_shapes = original


def _batches(lengths):
    gen = torch.Generator().manual_seed(0)
    out = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (4, length + 1), generator=gen)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def _train(mode, vpp, lengths):
    """Steps over batches of the given sequence lengths; per step, how many shape headers this rank exchanged."""
    os.environ[ENV] = mode
    state = ParallelState(ParallelLayout(2, pp=2), virtual_pipeline_size=vpp).activate()
    torch.manual_seed(0)
    module = TinyLM(SEQ)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    engine = StepEngine(module, state, device=torch.device("cpu"), micro_batch_size=2)
    grads = GradientState(list(module.parameters()), state, GradientConfig(), optimizers=[optimizer],
                          modules=[module])
    train = TrainStep(engine, grads, [module])
    headers = []   # per step (or run): the shape headers this rank exchanged

    def last_stage(microbatch):
        loss = module(microbatch).mean()
        return loss, loss.detach()

    losses = []
    with counting_headers(headers):
        for batch in _batches(lengths):
            headers.append(0)
            losses.append(float(train.step(batch, last_stage, optimizer).loss))
        for _ in range(2):   # validation: the same shapes (learned in training)
            headers.append(0)
            engine.run(_batches([SEQ])[0], last_stage, forward_only=True)
        ragged = {k: v[:3] for k, v in _batches([SEQ])[0].items()}
        for _ in range(2):   # a ragged batch: micro-batches of 2 and 1 rows have no one shape, never learned
            headers.append(0)
            engine.run(ragged, last_stage, forward_only=True)
        params = full_parameters(module)   # collective
    engine.close()
    grads.close()
    return losses, params if dist.get_rank() == 0 else None, headers


@pytest.mark.parametrize("vpp", [None, 2])
def test_shapes_are_learned_once_per_micro_batch_shape_and_the_updates_stay_exact(vpp):
    lengths = [SEQ, SEQ, SEQ // 2, SEQ, SEQ // 2, SEQ // 2]
    learned = run_on_ranks(_train, 2, "learn", vpp, lengths, timeout=240)
    exchanged = run_on_ranks(_train, 2, "exchange", vpp, lengths, timeout=240)
    for (losses, params, headers), (ref_losses, ref_params, ref_headers) in zip(learned, exchanged):
        assert losses == ref_losses   # bit for bit
        if params is not None:
            for name in ref_params:
                assert torch.equal(params[name], ref_params[name]), name
        assert all(n > 0 for n in ref_headers)   # every exchange with its header
        # the first step of each sequence length exchanges headers (and learns); later ones none, validation too;
        # micro-batches of two shapes in one step always exchange them
        assert [n > 0 for n in headers] == [True, False, True, False, False, False, False, False, True, True], headers


def test_the_signature_is_the_micro_batches_shapes_and_dtypes():
    a, b = _batches([SEQ, SEQ])
    assert signature([a, a]) == signature([b, b])
    assert signature([a]) != signature([a, a])
    assert signature([a]) != signature(_batches([SEQ // 2]))
    assert signature([a]) != signature([{k: v.float() for k, v in a.items()}])
    assert one_shape([(2, 3), (2, 3)]) == (2, 3) and one_shape([(2, 3), (3, 3)]) is None and one_shape([]) is None


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv(ENV, "exchange")
    assert not learning_enabled()
    monkeypatch.delenv(ENV)
    assert learning_enabled()
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match="LIGHTNING_MEGATRON_PIPELINE_SHAPES='sometimes': use 'learn'"):
        learning_enabled()


class _Stage(nn.Module):
    """Pipeline stage ``rank`` of 4: the second turns activations of 8 features into 4, the others keep theirs."""

    def __init__(self, rank):
        super().__init__()
        self.rank, self.input = rank, None
        self.linear = nn.Linear(8 if rank <= 1 else 4, 8 if rank == 0 else 4)

    def set_input_tensor(self, tensor):
        self.input = tensor

    def forward(self, batch):
        return self.linear(batch["x"] if self.rank == 0 else self.input)


class _Pipeline(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.stage = _Stage(rank)

    def forward(self, batch):
        return self.stage(batch)


def _shape_changing_stages():
    """Two training steps of 4 stages where one stage changes the activation shape; headers per step on this rank."""
    os.environ[ENV] = "learn"
    state = ParallelState(ParallelLayout(4, pp=4)).activate()
    torch.manual_seed(0)
    module = _Pipeline(state.pp_rank)
    engine = StepEngine(module, state, device=torch.device("cpu"), micro_batch_size=2)
    headers = []   # per step (or run): the shape headers this rank exchanged

    def last_stage(microbatch):
        loss = module(microbatch).square().mean()
        return loss, loss.detach()

    with counting_headers(headers):
        for _ in range(2):
            headers.append(0)
            engine.run({"x": torch.randn(4, 8)}, last_stage)
    engine.close()
    return headers


def test_no_stage_learns_a_shape_unless_every_stage_saw_the_same_one():
    """The first and last stages each see one shape, the second two: had the first learned its own, it would send
    without the header the second waits for. Every stage keeps exchanging headers."""
    for headers in run_on_ranks(_shape_changing_stages, 4, timeout=90):
        assert len(headers) == 2 and all(n > 0 for n in headers), headers
