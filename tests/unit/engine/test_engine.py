"""The step engine and the step protocol (``TrainStep``), driven by a plain Python loop (no Lightning): every
layout gives the parameters of one process training the whole batch with plain PyTorch, MoE expert biases
move exactly as through the Trainer, and no activation outlives its step."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.distributed.config import GradientConfig
from lightning_megatron.distributed.gradients import GradientState
from lightning_megatron.engine import StageOutput, StepEngine
from lightning_megatron.engine.train_step import TrainStep
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks
from helpers.engine_utils import TinyLM
from helpers.strategy_utils import SEQ, VOCAB, assert_same_updates, full_parameters

GLOBAL_BATCH, STEPS, LR = 8, 3, 2.0


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
    train = TrainStep(engine, grads, [module])
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
        result = train.step({k: v[mine] for k, v in batch.items()}, last_stage, optimizer)
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


def _moe_config():
    from lightning_megatron.moe import MoEConfig

    return dict(moe=MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2, aux_loss_coeff=1e-2,
                              enable_expert_bias=True, expert_bias_update_rate=0.05), moe_layer_freq=2)


def _expert_biases(module):
    return [r.expert_bias.clone() for r in module.modules() if getattr(r, "expert_bias", None) is not None]


def _moe_through_the_trainer(strategy_kwargs):
    import lightning as L
    from helpers.strategy_utils import fit_and_record

    biases = []

    class RecordBiases(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            biases.append(_expert_biases(module))

    out = fit_and_record(strategy_kwargs, module_kwargs=_moe_config(), max_steps=3,
                         trainer_kwargs=dict(callbacks=[RecordBiases()]))
    return biases, out["params"]


def _moe_in_a_plain_loop(layout, micro_batch_size):
    """The same model, data and seed as ``fit_tiny_gpt``, trained by ``TrainStep.step`` without Lightning."""
    import lightning as L
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_megatron.engine.replicas import make_replicas_identical, seed_identically
    from lightning_megatron.transformer import model_defaults
    from helpers.strategy_utils import TinyGPT, TokenData

    L.seed_everything(0, verbose=False)
    state = ParallelState(ParallelLayout(dist.get_world_size(), **layout)).activate()
    seed_identically(state, torch.device("cpu"))
    module = TinyGPT(**_moe_config())
    with model_defaults(sequence_parallel=False):
        module.configure_model()
    make_replicas_identical(module, state)
    optimizer = module.configure_optimizers()
    engine = StepEngine(module, state, device=torch.device("cpu"), micro_batch_size=micro_batch_size)
    grads = GradientState(list(module.parameters()), state, GradientConfig(), optimizers=[optimizer], modules=[module])
    train = TrainStep(engine, grads, [module])

    def last_stage(microbatch):
        loss = module(microbatch).mean()
        return StageOutput(loss=loss, logs={"loss": (loss, "mean")})

    dataset = TokenData(n=64)   # Lightning's training sampler: shuffled by the global seed
    data = DataLoader(dataset, batch_size=8 // state.dp_size,
                      sampler=DistributedSampler(dataset, state.dp_size, state.dp_rank, shuffle=True, seed=0))
    biases, params = [], []
    for _, batch in zip(range(3), data):
        result = train.step(batch, last_stage, optimizer)
        logged, op = result.logs["loss"]   # returned, combined over micro-batches; this data-parallel rank's
        assert op == "mean"
        over_dp = logged.clone()
        dist.all_reduce(over_dp)
        torch.testing.assert_close(over_dp / state.dp_size, result.loss, rtol=1e-6, atol=0)
        biases.append(_expert_biases(module))
        params.append(full_parameters(module))
    return biases, params if dist.get_rank() == 0 else None


@pytest.mark.parametrize("world, strategy_kwargs, layout", [
    (1, dict(micro_batch_size=2), dict()),
    (2, dict(expert_model_parallel_size=2, micro_batch_size=2), dict(ep=2)),
])
def test_moe_expert_biases_update_in_a_plain_loop_exactly_as_through_the_trainer(world, strategy_kwargs, layout):
    trainer = run_on_ranks(_moe_through_the_trainer, world, strategy_kwargs, timeout=180)
    plain = run_on_ranks(_moe_in_a_plain_loop, world, layout, 2, timeout=180)
    for rank, ((ref_biases, ref_params), (biases, params)) in enumerate(zip(trainer, plain)):
        assert len(biases) == len(ref_biases) == 3
        assert any(float(b.abs().max()) > 0 for b in biases[-1]), "the biases never moved"
        for step, (got, ref) in enumerate(zip(biases, ref_biases)):
            for b, r in zip(got, ref):
                torch.testing.assert_close(b, r, rtol=0, atol=1e-6, msg=lambda m: f"rank {rank} step {step}: {m}")
        if ref_params is not None:
            assert_same_updates(params, ref_params)


def _activations_after_a_step(vpp):
    """Under pipeline parallelism the later stage receives activations: none may stay referenced after the step
    (the roots' stored input, its gradient)."""
    state = ParallelState(ParallelLayout(dist.get_world_size(), pp=2), virtual_pipeline_size=vpp).activate()
    torch.manual_seed(0)
    module = TinyLM()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    engine = StepEngine(module, state, device=torch.device("cpu"), micro_batch_size=2)
    train = TrainStep(engine, GradientState(list(module.parameters()), state, optimizers=[optimizer],
                                            modules=[module]), [module])
    holders = [m for m in module.modules() if "input_tensor" in vars(m)]   # where the chunks keep what they received
    received = []

    def last_stage(microbatch):
        received.extend(weakref.ref(h.input_tensor) for h in holders if h.input_tensor is not None)
        loss = module(microbatch).mean()
        return loss, loss.detach()

    train.step(_batches()[0], last_stage, optimizer)
    gc.collect()
    return len(received), sum(ref() is not None for ref in received), [h.input_tensor is None for h in holders]


@pytest.mark.parametrize("vpp", [None, 2])
def test_no_received_activation_outlives_its_step(vpp):
    first, last = run_on_ranks(_activations_after_a_step, 2, vpp, timeout=120)
    assert last[0] > 0                         # the last stage did receive activations ...
    assert last[1] == 0 and first[1] == 0      # ... and none is alive after the step
    assert all(last[2]) and all(first[2])
