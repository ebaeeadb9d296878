"""bf16-true through the strategy is, bit for bit, the plain PyTorch loop a user would write: same losses,
same parameters after every AdamW update (clipping at 1.0 with the global norm accumulated in float32, as
the strategy does and the loop below spells out; torch's own ``clip_grad_norm_`` rounds the norm to bf16,
which moves the loss by ~1e-4 within a few steps).

The float32 equivalence tests cannot see a bf16-only slip (an update applied in the wrong dtype, a loss or
clip coefficient rounded differently, a gradient scaled twice): this one compares every step's update."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.testing import run_on_ranks

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 12


def _config():
    from lightning_megatron.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, activation="gelu_tanh")


def _batches():
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [ids[i * BATCH:(i + 1) * BATCH] for i in range(STEPS)]


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _clip_in_float32(params, max_norm):
    """What a careful user writes for bf16 gradients: the global norm accumulated in float32."""
    grads = [p.grad for p in params]
    total = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).pow(2.0).sum() ** 0.5
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))


def _plain_loop(micro_batches):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    torch.set_num_threads(1)   # CPU reductions (LayerNorm's weight gradient) sum in an order set by the threads
    ParallelState(ParallelLayout(1)).activate()
    torch.manual_seed(0)
    model = GPTModel(_config(), VOCAB, SEQ).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params = [], []
    for batch in _batches():
        loss = 0
        for part in batch.chunk(micro_batches):   # gradient accumulation: the mean of the micro-batch means
            part_loss = model(part[:, :-1], labels=part[:, 1:]).mean() / micro_batches
            part_loss.backward()
            loss = loss + part_loss.detach()
        _clip_in_float32(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        params.append(_snapshot(model))
    return {"losses": losses, "params": params}


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.losses, self.params = [], []

    def configure_model(self):
        from lightning_megatron.models import GPTModel

        torch.set_num_threads(1)   # Lightning's launcher set cpu_count // processes: the plain loop's count
        self.model = GPTModel(_config(), VOCAB, SEQ)

    def training_step(self, batch, batch_idx):
        return self.model(batch[:, :-1], labels=batch[:, 1:]).mean()   # once per micro-batch

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach())   # the step's loss: the mean over its micro-batches
        self.params.append(_snapshot(self.model))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _through_the_trainer(strategy_kwargs):
    torch.manual_seed(0)
    module = _Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(**strategy_kwargs),
                        precision="bf16-true", max_steps=STEPS, gradient_clip_val=1.0, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(_batches(), batch_size=None))
    return {"losses": module.losses, "params": module.params}


LAYOUTS = {"one-micro-batch": dict(),
           "two-micro-batches": dict(micro_batch_size=BATCH // 2),
           "grad-buffers": dict(micro_batch_size=1, overlap_grad_reduce=True)}   # param.main_grad, 4 sums


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_true_steps_are_the_plain_loop_bit_for_bit(name):
    kwargs = LAYOUTS[name]
    plain = run_on_ranks(_plain_loop, 1, BATCH // kwargs.get("micro_batch_size", BATCH), timeout=120)[0]
    ours = run_on_ranks(_through_the_trainer, 1, kwargs, timeout=180, init_process_group=False)[0]
    assert len(ours["losses"]) == len(plain["losses"]) == STEPS
    assert torch.equal(torch.stack(ours["losses"]), torch.stack(plain["losses"]).to(ours["losses"][0].dtype))
    for step, (mine, reference) in enumerate(zip(ours["params"], plain["params"])):
        assert mine.keys() == reference.keys()
        for key in reference:
            assert mine[key].dtype == torch.bfloat16, key
            assert torch.equal(mine[key], reference[key]), f"step {step}: {key} differs"
    # the updates are real: every step moved the weights (a frozen model would also be "equal")
    first, last = plain["params"][0], plain["params"][-1]
    assert all(not torch.equal(first[n], last[n]) for n in first if n.endswith("weight"))
