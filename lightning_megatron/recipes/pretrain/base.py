"""What the pre-training recipes share: the model built in ``configure_model`` as this rank's virtual
pipeline chunks, and its FLOPs per sequence length counted once (the throughput callback asks every batch)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Dict, Optional, Union

import lightning as L
import torch

from ...transformer.flops import training_flops_per_sequence
from ...pipeline import VirtualChunks
from ...transformer import TransformerConfig

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict


class PretrainingModule(L.LightningModule, ABC):
    """Subclasses name ``model_class`` (``GPTModel`` or a subclass) and build ``transformer_config()`` from their
    hyper-parameters, which include ``vocab_size``, ``seq_length``, ``cross_entropy_chunk_size`` and
    ``pipeline_layout`` (``GPTModel``'s: None balances the pipeline stages by cost, "even", or a list by hand)."""

    model_class: type

    if TYPE_CHECKING:   # what save_hyperparameters() stores: keys read as attributes (Lightning types it loosely)
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(self) -> None:
        super().__init__()
        self._flops_per_sequence: Dict[int, int] = {}

    @abstractmethod
    def transformer_config(self) -> TransformerConfig:
        """The model's ``TransformerConfig`` from the recipe's hyper-parameters."""

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        config, h = self.transformer_config(), self.hparams
        self.model = VirtualChunks(lambda vp_rank: self.model_class(
            config, h.vocab_size, h.seq_length, vp_rank=vp_rank, cross_entropy_chunk_size=h.cross_entropy_chunk_size,
            pipeline_layout=h.pipeline_layout))

    def token_loss(self, losses: torch.Tensor, counted: Optional[torch.Tensor] = None) -> Union[torch.Tensor, dict]:
        """What ``training_step`` returns for per-token ``losses`` (``counted``: 1 where a token has a label,
        default all): their mean, or under ``MegatronStrategy(calculate_per_token_loss=True)`` their sum and
        count, which the strategy divides by the global batch's count (exact when rows, micro-batches and
        ranks hold different numbers of labelled tokens). Logs ``train_loss``, this batch's mean."""
        total, count = _sum_and_count(losses, counted)
        mean = total / count.clamp(min=1.0)   # masked_mean, from the sum and count returned below
        self.log("train_loss", mean, prog_bar=True, sync_dist=True)
        strategy = self._trainer.strategy if self._trainer is not None else None
        if getattr(strategy, "calculate_per_token_loss", False):
            return {"loss": total, "num_tokens": count}
        return mean

    def training_flops(self, batch: dict) -> int:
        """Model FLOPs of one forward and backward pass over ``batch`` (the whole model, counted once), for
        ``lightning_megatron.adapter.callbacks.MegatronThroughputMonitor``'s TFLOP/s and MFU."""
        b, s = batch["input_ids"].shape
        per_sequence = self._flops_per_sequence.get(s)
        if per_sequence is None:
            per_sequence = self._flops_per_sequence[s] = training_flops_per_sequence(
                self.transformer_config(), s, self.hparams.vocab_size)
        return b * per_sequence


def _sum_and_count(losses: torch.Tensor, counted: Optional[torch.Tensor]) -> tuple:
    """The sum of the counted token losses and how many were counted (a float32 device scalar)."""
    if counted is None:
        return losses.sum(), torch.full((), losses.numel(), dtype=torch.float32, device=losses.device)
    return (losses * counted).sum(), counted.sum().float()


def masked_mean(losses: torch.Tensor, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean of the counted token losses (0 when none is counted)."""
    total, count = _sum_and_count(losses, counted)
    return total / count.clamp(min=1.0)
