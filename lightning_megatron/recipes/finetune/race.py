"""BERT fine-tuned on RACE: each question's four [CLS] article [SEP] question+option [SEP]
sequences are scored by one linear head; the highest-scoring option is the answer."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..data.race import NUM_CHOICES
from .base import BertFinetuneModule
from .model import BertShape


class BertForRACE(BertFinetuneModule):
    """Reports ``val/acc_middle``, ``val/acc_high`` (``RaceDataModule``'s two dev sets) and ``val/acc_all``.

    Args: as ``BertForMNLI``; the defaults are seed 002 Table 6 for RACE with the 336M model
    (lr 2e-5 at a global batch of 32 for 3 epochs) and Megatron-LM's warm-up 0.065 and weight decay 0.1.
    """

    task = "BertForMultipleChoice"
    num_classes = NUM_CHOICES
    eval_names = ("middle", "high")

    def __init__(self, pretrained: Optional[str] = None, random_init: Optional[BertShape] = None, lr: float = 2e-5,
                 weight_decay: float = 0.1, warmup_fraction: float = 0.065,
                 adam_betas: Tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 config_overrides: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(pretrained, random_init, lr, weight_decay, warmup_fraction, adam_betas, adam_eps,
                         config_overrides)
        self.val_acc_all = self._accuracy()

    def on_validation_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.val_acc_all.update(logits.argmax(-1), labels)

    def on_validation_epoch_end(self) -> None:
        # Under pipeline parallelism only the last stage ran validation_step: the others have nothing to add.
        if self.val_acc_all.update_called:
            self.log("val/acc_all", self.val_acc_all.compute(), prog_bar=True)
        self.val_acc_all.reset()
