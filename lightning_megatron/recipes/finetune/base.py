"""What BertForMNLI and BertForRACE share: model building, loss, accuracy per dev set, AdamW schedule.

An ordinary LightningModule: the model is built in ``configure_model`` (under the megatron
strategy the process groups exist only then), ``forward`` takes the batch dict, ``training_step``
returns the cross-entropy loss, ``validation_step`` updates one torchmetrics accuracy per
validation dataloader. After each validation, rank 0 prints the dev accuracies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, cast

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from ..data.datasets import IGNORE_LABEL
from ..data.sources import resolve_pretrained
from ...transformer.flops import linear_training_flops, training_flops_per_sequence
from .model import BertShape, build_task_model
from .optim import adamw_with_warmup

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

    from ...models.bert import BertModel


class BertFinetuneModule(L.LightningModule):
    """Subclasses set ``task`` (model class), ``num_classes``, ``eval_names`` (one per validation
    dataloader, in order) and ``task_kwargs()``."""

    task: str = ""
    num_classes: int = 0
    eval_names: Tuple[str, ...] = ()

    if TYPE_CHECKING:   # what save_hyperparameters() stores: keys read as attributes (Lightning types it loosely)
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(self, pretrained: Optional[str] = None, random_init: Optional[BertShape] = None, lr: float = 1e-5,
                 weight_decay: float = 0.1, warmup_fraction: float = 0.065,
                 adam_betas: Tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 config_overrides: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.pretrained = pretrained
        self.random_init = random_init
        self.model: Optional[nn.Module] = None
        self.val_acc = nn.ModuleDict({name: self._accuracy() for name in self.eval_names})

    def _accuracy(self) -> MulticlassAccuracy:
        return MulticlassAccuracy(num_classes=self.num_classes, average="micro", ignore_index=IGNORE_LABEL)

    def task_kwargs(self) -> Dict[str, Any]:
        return {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        self.model = build_task_model(
            self.task, resolve_pretrained(self.pretrained), self.random_init,
            getattr(datamodule, "vocab_size", None), self.hparams.config_overrides, **self.task_kwargs())

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        assert self.model is not None   # configure_model built it
        return self.model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])

    def training_flops(self, batch: Dict[str, torch.Tensor]) -> Optional[int]:
        """Model FLOPs of one forward and backward pass over ``batch`` (the whole model, counted once, on the
        padded sequences as computed), for ``lightning_megatron.adapter.callbacks.MegatronThroughputMonitor``."""
        if self.model is None:
            return None
        config = cast("BertModel", self.model.bert).config   # every task model holds its encoder as .bert
        ids = batch["input_ids"]                      # [b, s], or [b, choices, s] (each choice one sequence)
        seq = ids.shape[-1]
        sequences = ids.numel() // seq
        heads = (linear_training_flops(config.hidden_size, config.hidden_size)          # pooler on [CLS]
                 + linear_training_flops(config.hidden_size, self.task_kwargs().get("num_labels", 1)))
        return sequences * (training_flops_per_sequence(config, seq) + heads)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(self(batch), batch["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["labels"].numel(), sync_dist=True)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx >= len(self.eval_names):
            raise IndexError(f"{type(self).__name__} expects {len(self.eval_names)} validation dataloaders "
                             f"{list(self.eval_names)}, got dataloader {dataloader_idx}.")
        name = self.eval_names[dataloader_idx]
        logits = self(batch)
        labels = batch["labels"]
        accuracy = cast(MulticlassAccuracy, self.val_acc[name])
        accuracy(logits.argmax(-1), labels)
        size = labels.numel()
        self.log(f"val/loss_{name}", self._loss(logits, labels), add_dataloader_idx=False, batch_size=size,
                 sync_dist=True)
        self.log(f"val/acc_{name}", accuracy, add_dataloader_idx=False, batch_size=size, prog_bar=True)
        self.on_validation_predictions(logits, labels)

    def on_validation_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Hook for metrics over all dev sets (RACE's 'all')."""

    def on_validation_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        accuracies = {k[len("val/acc_"):]: float(v) for k, v in self.trainer.callback_metrics.items()
                      if k.startswith("val/acc_")}
        if accuracies:
            shown = ", ".join(f"{name} {value:.4f}" for name, value in accuracies.items())
            self.print(f"dev accuracy (epoch {self.current_epoch}, step {self.global_step}): {shown}")

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        h = self.hparams
        return adamw_with_warmup(self, h.lr, h.weight_decay, h.adam_betas, h.adam_eps, h.warmup_fraction,
                                 int(self.trainer.estimated_stepping_batches))
