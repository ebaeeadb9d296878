"""BERT fine-tuned on MultiNLI: 3-way classification of [CLS] premise [SEP] hypothesis [SEP]."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..data.mnli import MNLI_LABELS
from .base import BertFinetuneModule
from .model import BertShape


class BertForMNLI(BertFinetuneModule):
    """Reports ``val/acc_matched`` and ``val/acc_mismatched`` (``MNLIDataModule``'s two dev sets).

    Args:
        pretrained: a Hugging Face BERT directory, ``"minilm"``, ``"minilm-if-installed"`` (random
            init without it), or ``None`` for a randomly initialized ``random_init`` BERT.
        lr / weight_decay / warmup_fraction / adam_*: AdamW, linear warm-up over ``warmup_fraction``
            of the steps, then linear decay to zero. Defaults: seed 002 Table 6 for MNLI (lr 1e-5 at
            a global batch of 128 for 10 epochs) and Megatron-LM's fine-tuning scripts (warm-up
            0.065, weight decay 0.1).
        config_overrides: ``TransformerConfig`` fields to change (dropout, ``recompute_layers``...).
    """

    task = "BertForSequenceClassification"
    num_classes = len(MNLI_LABELS)
    eval_names = ("matched", "mismatched")

    def __init__(self, pretrained: Optional[str] = None, random_init: Optional[BertShape] = None, lr: float = 1e-5,
                 weight_decay: float = 0.1, warmup_fraction: float = 0.065,
                 adam_betas: Tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 config_overrides: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(pretrained, random_init, lr, weight_decay, warmup_fraction, adam_betas, adam_eps,
                         config_overrides)

    def task_kwargs(self) -> Dict[str, Any]:
        return {"num_labels": self.num_classes}
