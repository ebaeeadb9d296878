"""MoE models imported from Hugging Face configs with ``output_router_logits=True`` train with transformers' own
balancing loss (``aux_loss_type="hf_pooled"``: pooled over every layer), so one step through the Trainer equals
transformers' same step: the reported cross-entropy plus balancing loss equals transformers' ``loss``, and the
exported weights after one AdamW step equal transformers' updated ones, at one rank, TP2 (with sequence
parallelism: tokens split over tp), PP2 (layers on two stages: their statistics meet across the stages) and EP2
(dp2: one loss per data-parallel replica's forward, as transformers under DDP / gradient accumulation).

AdamW's first step divides each gradient by its magnitude; ``eps=1`` keeps the update proportional to the gradient
(for gradients well below 1), so a wrong balancing-loss gradient shows in the weights.
"""

import glob
import os

import lightning as L
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import Dataset

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import fit_tiny_gpt

VOCAB, SEQ, BATCH, COEF = 100, 16, 2, 0.5
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=VOCAB,
              max_position_embeddings=64, num_hidden_layers=2, num_key_value_heads=2, output_router_logits=True,
              router_aux_loss_coef=COEF)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                       norm_topk_prob=True)),
}
LAYOUTS = {   # world size, strategy options
    "1": (1, dict()),
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "ep2": (2, dict(expert_model_parallel_size=2)),   # dp2: each replica one sequence
}
OPTIMIZER = dict(lr=1.0, eps=1.0, weight_decay=0.01)


def tiny_hf(kind, path):
    config_cls, model_cls, extra = FAMILIES[kind]
    torch.manual_seed(1)
    model = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():   # routers start at zero in transformers (uniform routing, ties): random ones here
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "proj.bias")):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def hf_state(path):
    out = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        out.update(load_file(file))
    return out


class Rows(Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = torch.cat([self.ids[i, 1:], torch.tensor([-100])])   # transformers shifts inside; we do not
        return {"input_ids": self.ids[i], "labels": labels}


class ImportedMoE(L.LightningModule):
    """An HF MoE checkpoint imported in ``configure_model``; logs the cross-entropy and the balancing loss."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.step_losses = []

    def configure_model(self):
        if not hasattr(self, "model"):
            from lightning_megatron.models.hf_llama import llama_from_hf

            self.model = llama_from_hf(self.path)

    def forward(self, batch):
        return self.model(batch["input_ids"], labels=batch["labels"])

    def training_step(self, batch, batch_idx):
        from lightning_megatron.moe import collect_aux_losses
        from lightning_megatron.parallel import get_parallel_state

        per_token = self(batch)
        loss = per_token.sum() / (batch["labels"] != -100).sum()
        aux = collect_aux_losses(self, group=get_parallel_state().group("tp-cp"))["load_balancing_loss"]
        self.log("ce", loss, sync_dist=True)
        self.log("aux", aux, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), **OPTIMIZER)


class Export(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, module):
        from lightning_megatron.models.hf_llama import save_hf_llama

        save_hf_llama(module.model, self.out)


def _train_and_export(strategy_kwargs, path, ids, out):
    result = fit_tiny_gpt(strategy_kwargs, global_batch_size=BATCH, max_steps=1, module_cls=ImportedMoE,
                          module_kwargs=dict(path=path), dataset=Rows(ids),
                          trainer_kwargs=dict(callbacks=[Export(out)]))
    return result["logged"]


def hf_step(model, ids, replicas):
    """transformers' loss (each data-parallel replica's forward its own, averaged) and its AdamW step."""
    model.train()
    losses = [model(part, labels=part).loss for part in ids.chunk(replicas)]
    loss = torch.stack(losses).mean()
    loss.backward()
    torch.optim.AdamW(model.parameters(), **OPTIMIZER).step()
    return float(loss)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_one_step_equals_transformers(kind, layout, tmp_path):
    world, strategy_kwargs = LAYOUTS[layout]
    path, out = str(tmp_path / "hf"), str(tmp_path / "after")
    model = tiny_hf(kind, path)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    logged = run_on_ranks(_train_and_export, world, strategy_kwargs, path, ids, out, timeout=240)[0]
    replicas = world // (strategy_kwargs.get("tensor_model_parallel_size", 1)
                         * strategy_kwargs.get("pipeline_model_parallel_size", 1))
    expected = hf_step(model, ids, replicas)
    # the last stage reports the whole pooled loss: every stage's statistics reach it
    assert logged["ce"] + logged["aux"] == pytest.approx(expected, abs=1e-5)
    assert logged["aux"] > 0.1
    model.save_pretrained(str(tmp_path / "theirs"))
    theirs, ours = hf_state(str(tmp_path / "theirs")), hf_state(out)
    assert ours.keys() == theirs.keys()
    worst = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    print(f"{kind} {layout}: max |Δparam| after one AdamW step = {worst:.2e}")
    assert worst < 1e-5
