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


class PackedTokenData(TokenData):
    """Rows of several documents (1 to 5 tokens, padding at some rows' ends): ``position_ids`` restart per
    document, ``document_ids`` 0, 1, ... per row and -1 on padding (``corpus.PackedDocuments``' format)."""

    def __init__(self, n=64, seed=0):
        super().__init__(n, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.documents = torch.full((n, SEQ), -1, dtype=torch.long)
        self.positions = torch.zeros(n, SEQ, dtype=torch.long)
        for row in range(n):
            at, doc = 0, 0
            fill = SEQ - int(torch.randint(0, 3, (), generator=gen))   # 0 to 2 tokens of padding
            while at < fill:
                length = min(int(torch.randint(1, 6, (), generator=gen)), fill - at)
                self.documents[row, at:at + length] = doc
                self.positions[row, at:at + length] = torch.arange(length)
                at, doc = at + length, doc + 1

    def __getitem__(self, i):
        return dict(super().__getitem__(i), position_ids=self.positions[i], document_ids=self.documents[i])


class TinyGPT(L.LightningModule):
    def __init__(self, layers=4, lr=2.0, dropout=0.0, pipeline_layout=None, gpt_kwargs=None, **config):
        super().__init__()
        self.layers, self.lr, self.config = layers, lr, config   # config: extra TransformerConfig fields
        self.gpt_kwargs = gpt_kwargs or {}                      # extra GPTModel keywords
        self.pipeline_layout = pipeline_layout
        self.dropout = dropout
        self.step_losses = []

    def configure_model(self):
        if hasattr(self, "model"):   # Lightning calls it at every fit/validate/test/predict
            return
        cfg = TransformerConfig(num_layers=self.layers, hidden_size=16, num_attention_heads=4,
                                hidden_dropout=self.dropout, attention_dropout=self.dropout, **self.config)
        self.model = VirtualChunks(lambda vp_rank: GPTModel(cfg, VOCAB, SEQ, vp_rank=vp_rank,
                                                            pipeline_layout=self.pipeline_layout, **self.gpt_kwargs))

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
                 val_dataloader=None, checkpoint_to=None, resume_from=None, module_cls=None, dataset_size=64,
                 dataset=None, accelerator="cpu"):
    """Train on every rank of the harness world (the global batch split over data-parallel ranks);
    ``dataset``: instead of ``TokenData(n=dataset_size)``."""
    world = int(__import__("os").environ["WORLD_SIZE"])
    model_parallel = strategy_kwargs.get("tensor_model_parallel_size", 1) * strategy_kwargs.get(
        "pipeline_model_parallel_size", 1) * strategy_kwargs.get("context_parallel_size", 1)
    batch_size = global_batch_size // max(1, world // max(1, model_parallel))
    L.seed_everything(0, verbose=False)
    module = (module_cls or TinyGPT)(**(module_kwargs or {}))
    options = dict(max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    options.update(trainer_kwargs or {})
    trainer = L.Trainer(strategy=MegatronStrategy(**strategy_kwargs), accelerator=accelerator, devices=world,
                        **options)
    data = dataset if dataset is not None else TokenData(n=dataset_size)
    trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=False), val_dataloader, ckpt_path=resume_from)
    if checkpoint_to is not None:
        trainer.save_checkpoint(checkpoint_to)
    return {"losses": module.step_losses, "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "probe": getattr(module, "sums", None)}


class AdamGPT(TinyGPT):
    """TinyGPT with AdamW: checkpoints then hold optimizer state (moments and step counts), not just weights."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_saving_every_step(folder, max_steps, background, resume_from=None, callbacks=(), keep=-1, accelerator="cpu"):
    """TP2 ``AdamGPT`` with dropout, a ``ModelCheckpoint`` into ``folder`` at every step (``keep``: its
    ``save_top_k``), written in the background (``AsyncCheckpointIO``) or not; the losses. Restores ``WORLD_SIZE``,
    which Lightning's teardown of a process group it made takes away, so a second fit can follow."""
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    world = os.environ["WORLD_SIZE"]
    every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=keep, filename="{step}")
    options = dict(enable_checkpointing=True, callbacks=[every_step, *callbacks])
    if background:
        options["plugins"] = [AsyncCheckpointIO()]
    try:
        return fit_tiny_gpt(dict(tensor_model_parallel_size=2), max_steps=max_steps, dataset_size=32,
                            module_cls=AdamGPT, module_kwargs=dict(dropout=0.1), trainer_kwargs=options,
                            resume_from=resume_from, accelerator=accelerator)["losses"]
    finally:
        os.environ["WORLD_SIZE"] = world


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


def validate_tiny_gpt(strategy_kwargs, global_batch_size=8, module_cls=TinyGPTWithAccuracy, dataset_size=32):
    world = int(__import__("os").environ["WORLD_SIZE"])
    mp = strategy_kwargs.get("tensor_model_parallel_size", 1) * strategy_kwargs.get("pipeline_model_parallel_size", 1)
    L.seed_everything(0, verbose=False)
    module = module_cls()
    trainer = L.Trainer(strategy=MegatronStrategy(**strategy_kwargs), accelerator="cpu", devices=world,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, DataLoader(TokenData(n=dataset_size, seed=1), batch_size=global_batch_size // (world // mp)),
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


def full_parameters(module):
    """Every parameter as the single-process model holds it (global name, TP/ETP shards joined, experts
    gathered over EP, every pipeline stage's share), on every rank; float32 on the CPU.

    Copies of one parameter (data-parallel replicas, the last stage's tied output weight, an expert on
    its expert-data-parallel replicas) must be equal: an update that differs between copies fails here.
    """
    import torch.distributed as dist

    from lightning_megatron.models.sharding import global_names
    from lightning_megatron.parallel import get_parallel_state
    from helpers.tp_utils import full_tensor

    state = get_parallel_state()
    names = global_names(module)
    mine = {}
    for local, param in module.named_parameters():
        full = full_tensor(param, param, state)
        if local.endswith(("word_embeddings.weight", "output_weight")):
            full = full[:VOCAB]   # rows past the vocabulary pad the table for TP
        mine[names[local]] = full.float().cpu().clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {}
    for rank, part in enumerate(gathered):
        for name, tensor in part.items():
            if name in merged:
                torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6,
                                           msg=lambda m: f"copies of {name} differ (rank {rank}): {m}")
            merged[name] = tensor
    return merged


class RecordParameters(L.Callback):
    """The whole model after every optimizer step (what one process would hold)."""

    def __init__(self):
        self.after_step = []

    def on_train_batch_end(self, trainer, module, *args):
        trainer.strategy.finish_param_sync()
        self.after_step.append(full_parameters(module))


def fit_and_record(strategy_kwargs, module_kwargs=None, max_steps=3, **kwargs):
    """``fit_tiny_gpt`` that also returns the full model after each step (compare updates, not only
    losses: an update scaled wrongly by a group size is invisible in a clipped run's losses)."""
    record = RecordParameters()
    trainer_kwargs = dict(kwargs.pop("trainer_kwargs", None) or {})
    trainer_kwargs["callbacks"] = list(trainer_kwargs.get("callbacks", [])) + [record]
    out = fit_tiny_gpt(strategy_kwargs, max_steps=max_steps, trainer_kwargs=trainer_kwargs,
                       module_kwargs=module_kwargs, **kwargs)
    out["params"] = record.after_step if int(__import__("os").environ["RANK"]) == 0 else None
    return out


def assert_same_run(out, reference):
    """Every rank's run (``fit_and_record`` results) equals the one-process ``reference``: rank 0's parameter updates
    and every rank's losses."""
    import pytest

    assert_same_updates(out[0]["params"], reference["params"])
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)


def assert_same_updates(got, ref, rtol=1e-5, atol=1e-6):
    """Parameters after every step equal the single process's (so every gradient and update did)."""
    assert len(got) == len(ref)
    for step, (params, ref_params) in enumerate(zip(got, ref)):
        assert params.keys() == ref_params.keys()
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"step {step}, {name}: {m}")


class AuxLoggingGPT(TinyGPT):
    """Logs the MoE balancing losses of each micro-batch's forward, whole-sequence values (summed over the
    tp-cp ranks that each hold a share of the tokens), as a user would."""

    def training_step(self, batch, batch_idx):
        from lightning_megatron.moe import collect_aux_losses
        from lightning_megatron.parallel import get_parallel_state

        loss = super().training_step(batch, batch_idx)
        for name, value in collect_aux_losses(self, group=get_parallel_state().group("tp-cp")).items():
            self.log(name, value, sync_dist=True)
        return loss
