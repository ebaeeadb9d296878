"""The step engine and the gradient state, driven by a plain Python loop (no Lightning): every layout
gives the parameters of one process training the whole batch with plain PyTorch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.distributed.config import GradientConfig
from lightning_megatron.distributed.gradients import GradientState
from lightning_megatron.engine import StepEngine
from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline import VirtualChunks
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig
from helpers.strategy_utils import SEQ, VOCAB, assert_same_updates, full_parameters

GLOBAL_BATCH, STEPS, LR = 8, 3, 2.0


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                attention_dropout=0.0)
        self.model = VirtualChunks(lambda vp_rank: GPTModel(cfg, VOCAB, SEQ, vp_rank=vp_rank))

    def forward(self, batch):
        return self.model(batch["input_ids"], labels=batch["labels"])


def _batches():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return [{"input_ids": b[:, :-1], "labels": b[:, 1:]} for b in ids]


def _plain_pytorch():
    """One process, no library machinery around the model: the reference."""
    state = ParallelState(ParallelLayout(1)).activate()
    torch.manual_seed(0)
    module = TinyLM()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    params, losses = [], []
    for batch in _batches():
        optimizer.zero_grad()
        loss = module(batch).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        params.append(full_parameters(module))
    state.destroy()
    return losses, params


def _engine_loop(layout, micro_batch_size, vpp=None, per_token=False, **gradient_options):
    """The loop a user without Lightning writes around the engine (``per_token``: the last stage returns
    token-loss sums and counts, the gradients are multiplied by the result's ``grad_scale``)."""
    world = dist.get_world_size()
    state = ParallelState(ParallelLayout(world, **layout), virtual_pipeline_size=vpp).activate()
    torch.manual_seed(0)
    module = TinyLM()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    engine = StepEngine(module, state, device=torch.device("cpu"), micro_batch_size=micro_batch_size,
                        calculate_per_token_loss=per_token)
    grads = GradientState(list(module.parameters()), state, GradientConfig(**gradient_options), optimizers=[optimizer],
                          modules=[module])
    per_rank = GLOBAL_BATCH // state.dp_size
    mine = slice(state.dp_rank * per_rank, (state.dp_rank + 1) * per_rank)

    def last_stage(microbatch):
        if per_token:
            losses = module(microbatch)
            return losses.sum(), losses.sum().detach(), losses.numel()
        loss = module(microbatch).mean()
        return loss, loss.detach()

    losses, params = [], []
    for batch in _batches():
        grads.zero()
        grads.before_schedule()
        result = engine.run({k: v[mine] for k, v in batch.items()}, last_stage, no_sync=grads.schedule_no_sync)
        grads.finalize([module])
        if per_token:
            grads.scale(result.grad_scale)
        grads.expose()
        optimizer.step()
        grads.after_optimizer_step()
        losses.append(float(result.loss))
        params.append(full_parameters(module))
    engine.close()
    grads.close()
    return losses, (params if dist.get_rank() == 0 else None)


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(_plain_pytorch, 1, timeout=120)[0]


@pytest.mark.parametrize("world, layout, micro_batch_size, vpp, options", [
    (1, dict(), 2, None, dict()),
    (2, dict(), None, None, dict()),                                          # dp2
    (2, dict(tp=2), 2, None, dict(overlap_grad_reduce=True, bucket_size=600)),
    (2, dict(pp=2), 1, 2, dict()),                                             # interleaved
    (4, dict(tp=2, pp=2), 2, None, dict(use_distributed_optimizer=True)),     # dp1: sharded over one rank
    (4, dict(pp=2), 2, None, dict(use_distributed_optimizer=True)),           # dp2
])
def test_engine_in_a_plain_loop_equals_plain_pytorch(reference, world, layout, micro_batch_size, vpp, options):
    ref_losses, ref_params = reference
    for rank, (losses, params) in enumerate(run_on_ranks(_engine_loop, world, layout, micro_batch_size, vpp,
                                                         timeout=180, **options)):
        assert losses == pytest.approx(ref_losses, rel=1e-5), rank   # the step's loss on every rank
        if params is not None:
            assert_same_updates(params, ref_params)


@pytest.mark.parametrize("world, layout, micro_batch_size, options", [
    (2, dict(), 2, dict()),                                              # dp2, plain .grad
    (4, dict(pp=2), 2, dict(use_distributed_optimizer=True)),            # dp2 over pp2, sharded buffers
])
def test_engine_with_per_token_sums_equals_plain_pytorch(reference, world, layout, micro_batch_size, options):
    """Every token counts here, so the global token mean is the plain mean of the reference."""
    ref_losses, ref_params = reference
    for losses, params in run_on_ranks(_engine_loop, world, layout, micro_batch_size, None, True, timeout=180,
                                       **options):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        if params is not None:
            assert_same_updates(params, ref_params, rtol=1e-4, atol=1e-5)


def _eval_outputs():
    state = ParallelState(ParallelLayout(dist.get_world_size(), pp=2)).activate()
    torch.manual_seed(0)
    module = TinyLM()
    engine = StepEngine(module, state, device=torch.device("cpu"), micro_batch_size=2)
    batch = _batches()[0]
    with torch.no_grad():
        result = engine.run(batch, lambda mb: module(mb).mean(dim=1), forward_only=True,
                            step_context=torch.no_grad)
    assert result.loss is None
    return None if result.outputs is None else torch.cat(result.outputs)


def test_forward_only_returns_the_last_stage_outputs_per_micro_batch():
    out = run_on_ranks(_eval_outputs, 2, timeout=120)
    assert out[0] is None and out[1].shape == (GLOBAL_BATCH,)        # only the last stage has outputs
    ref = run_on_ranks(_plain_eval, 1, timeout=120)[0]
    torch.testing.assert_close(out[1], ref, rtol=1e-5, atol=1e-6)


def _plain_eval():
    ParallelState(ParallelLayout(1)).activate()
    torch.manual_seed(0)
    module = TinyLM()
    with torch.no_grad():
        return module(_batches()[0]).mean(dim=1)
