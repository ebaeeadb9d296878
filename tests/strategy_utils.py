"""A tiny GPT LightningModule and the Trainer runs the strategy tests compare."""

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_megatron import MegatronStrategy
from lightning_megatron.models import GPTModel
from lightning_megatron.pipeline import VirtualChunks
from lightning_megatron.transformer import TransformerConfig

VOCAB, SEQ = 64, 8


class TokenData(Dataset):
    def __init__(self, n=64, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class TinyGPT(L.LightningModule):
    def __init__(self, layers=4, lr=2.0, **config):
        super().__init__()
        self.layers, self.lr, self.config = layers, lr, config   # config: extra TransformerConfig fields
        self.step_losses = []

    def configure_model(self):
        cfg = TransformerConfig(num_layers=self.layers, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                attention_dropout=0.0, **self.config)
        self.model = VirtualChunks(lambda vp_rank: GPTModel(cfg, VOCAB, SEQ, vp_rank=vp_rank))

    def forward(self, batch):
        return self.model(batch["input_ids"], labels=batch["labels"])

    def training_step(self, batch, batch_idx):
        loss = self(batch).mean()
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self(batch).mean()
        self.log("val_loss", loss, sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit_tiny_gpt(strategy_kwargs, global_batch_size=8, max_steps=4, trainer_kwargs=None, module_kwargs=None,
                 val_dataloader=None, checkpoint_to=None, resume_from=None, module_cls=None, dataset_size=64):
    """Train on every rank of the harness world (the global batch split over data-parallel ranks)."""
    world = int(__import__("os").environ["WORLD_SIZE"])
    model_parallel = strategy_kwargs.get("tensor_model_parallel_size", 1) * strategy_kwargs.get(
        "pipeline_model_parallel_size", 1) * strategy_kwargs.get("context_parallel_size", 1)
    batch_size = global_batch_size // max(1, world // max(1, model_parallel))
    L.seed_everything(0, verbose=False)
    module = (module_cls or TinyGPT)(**(module_kwargs or {}))
    options = dict(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    options.update(trainer_kwargs or {})
    trainer = L.Trainer(strategy=MegatronStrategy(**strategy_kwargs), accelerator="cpu", devices=world, **options)
    trainer.fit(module, DataLoader(TokenData(n=dataset_size), batch_size=batch_size, shuffle=False), val_dataloader,
                ckpt_path=resume_from)
    if checkpoint_to is not None:
        trainer.save_checkpoint(checkpoint_to)
    return {"losses": module.step_losses, "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "probe": getattr(module, "sums", None)}


class TinyGPTWithAccuracy(TinyGPT):
    """Adds a torchmetrics next-token accuracy over the validation set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import torchmetrics

        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)

    def validation_step(self, batch, batch_idx):
        from lightning_megatron.tensor_parallel import gather_from_tensor_parallel_region

        logits = gather_from_tensor_parallel_region(self.model(batch["input_ids"]))[..., :VOCAB]
        self.val_acc(logits.argmax(-1), batch["labels"])
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_loss", self(batch).mean(), sync_dist=True)


def validate_tiny_gpt(strategy_kwargs, global_batch_size=8, module_cls=TinyGPTWithAccuracy):
    world = int(__import__("os").environ["WORLD_SIZE"])
    mp = strategy_kwargs.get("tensor_model_parallel_size", 1) * strategy_kwargs.get("pipeline_model_parallel_size", 1)
    L.seed_everything(0, verbose=False)
    module = module_cls()
    trainer = L.Trainer(strategy=MegatronStrategy(**strategy_kwargs), accelerator="cpu", devices=world,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, DataLoader(TokenData(n=32, seed=1), batch_size=global_batch_size // (world // mp)),
                               verbose=False)
    return {k: float(v) for k, v in metrics[0].items()}


class PredictingGPT(TinyGPT):
    def predict_step(self, batch, batch_idx):
        from lightning_megatron.context_parallel import all_gather_context_parallel
        from lightning_megatron.tensor_parallel import gather_from_tensor_parallel_region

        logits = gather_from_tensor_parallel_region(self.model(batch["input_ids"]))[..., :VOCAB]
        return all_gather_context_parallel(logits, seq_dim=1).argmax(-1)   # whole sequences under CP


def predict_tiny_gpt(strategy_kwargs, global_batch_size=4, dataset_size=10):
    world = int(__import__("os").environ["WORLD_SIZE"])
    mp = strategy_kwargs.get("tensor_model_parallel_size", 1) * strategy_kwargs.get("pipeline_model_parallel_size", 1) \
        * strategy_kwargs.get("context_parallel_size", 1)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=MegatronStrategy(**strategy_kwargs), accelerator="cpu", devices=world,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    out = trainer.predict(PredictingGPT(), DataLoader(TokenData(n=dataset_size, seed=2),
                                                      batch_size=global_batch_size // (world // mp)))
    return torch.cat(out) if trainer.is_global_zero else None
