"""``ChatFinetuning``: a Hugging Face Llama-family checkpoint fine-tuned on packed chat rows, exported back.

The checkpoint is imported in ``configure_model`` (``llama_from_hf``: each rank reads only its shards, at any
TP/SP/PP/VPP/CP/DP layout), rows come from ``ChatData`` (labels only on assistant tokens, attention inside
each conversation), and at the end of training every rank takes part in ``save_hf_llama``, which writes a
folder ``from_pretrained`` loads, with the tokenizer (and its chat template) beside it.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics.aggregation import MeanMetric

from ...models.hf_llama import config_from_hf, llama_from_hf, model_kwargs_from_hf, save_hf_llama
from ...pipeline import VirtualChunks
from ...transformer import TransformerConfig
from ...transformer.flops import training_flops_per_sequence
from ..finetune.optim import adamw_with_warmup
from ..pretrain.base import PretrainingModule
from .datamodule import IGNORE_INDEX


class ChatFinetuning(PretrainingModule):
    """Next-token loss on the assistant's tokens of packed conversations.

    Args:
        pretrained: a Hugging Face folder of a Llama-family model (``config.json``, safetensors).
        export_dir: where to write the fine-tuned model (Hugging Face layout, plus the datamodule's tokenizer) at
            the end of training; None: no export.
        export_dtype: the exported tensors' dtype (``"bfloat16"``, ``"float32"``, ...; None: the parameters').
        config_overrides: ``TransformerConfig`` fields to replace (e.g. ``{"recompute_layers": true}``).
        cross_entropy_chunk_size, pipeline_layout: ``GPTModel``'s arguments (fused chunked loss; layers per stage).

    The loss is the mean over the global batch's assistant tokens with ``MegatronStrategy(
    calculate_per_token_loss=True)`` (rows hold different numbers of them); ``val_loss`` is the validation set's
    mean over its assistant tokens. The learning rate warms up over ``warmup_fraction`` of the steps and
    decays linearly to 0 (AdamW, no weight decay on norms).
    """

    def __init__(self, pretrained: str, export_dir: Optional[str] = None, export_dtype: Optional[str] = None,
                 lr: float = 1e-5, weight_decay: float = 0.0, warmup_fraction: float = 0.03,
                 adam_betas: Tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8,
                 config_overrides: Optional[Dict[str, Any]] = None, cross_entropy_chunk_size: Optional[int] = None,
                 pipeline_layout: Union[None, str, List[int]] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.val_loss = MeanMetric()

    def transformer_config(self) -> TransformerConfig:
        return config_from_hf(self.hparams.pretrained, **(self.hparams.config_overrides or {}))

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        h = self.hparams
        self.model = VirtualChunks(lambda vp_rank: llama_from_hf(
            h.pretrained, vp_rank=vp_rank, config_overrides=h.config_overrides,
            cross_entropy_chunk_size=h.cross_entropy_chunk_size, pipeline_layout=h.pipeline_layout))

    def forward(self, batch: dict) -> torch.Tensor:
        """Per-token losses ``[b, s]`` (0 where the label is ignored); attention stays inside each conversation."""
        return self.model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                          document_ids=batch["document_ids"])

    def on_fit_start(self) -> None:
        if not getattr(self.trainer.strategy, "calculate_per_token_loss", False):
            rank_zero_warn("ChatFinetuning without MegatronStrategy(calculate_per_token_loss=True): each micro-batch's "
                           "mean loss weighs the same, so an assistant token in a row with few of them weighs more.")

    def training_step(self, batch: dict, batch_idx: int) -> Union[torch.Tensor, dict]:
        return self.token_loss(self(batch), (batch["labels"] != IGNORE_INDEX).float())

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        counted = (batch["labels"] != IGNORE_INDEX).float()
        count = counted.sum()
        self.val_loss.update((self(batch) * counted).sum() / count.clamp(min=1.0), weight=count)
        self.log("val_loss", self.val_loss, prog_bar=True)

    def training_flops(self, batch: dict) -> int:
        b, s = batch["input_ids"].shape
        if s not in self._flops_per_sequence:
            vocab = model_kwargs_from_hf(self.hparams.pretrained)["vocab_size"]
            self._flops_per_sequence[s] = training_flops_per_sequence(self.transformer_config(), s, vocab)
        return b * self._flops_per_sequence[s]

    def on_train_end(self) -> None:
        h = self.hparams
        if h.export_dir is None:
            return
        save_hf_llama(self.model, h.export_dir, dtype=getattr(torch, h.export_dtype) if h.export_dtype else None)
        tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
        if self.trainer.is_global_zero:
            if tokenizer is not None:
                tokenizer.save_pretrained(h.export_dir)
            print(f"exported the fine-tuned model to {os.path.abspath(h.export_dir)}", flush=True)

    def on_fit_end(self) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        if self.trainer.is_global_zero:
            print("final " + " ".join(f"{k}={v:.7g}" for k, v in sorted(metrics.items())), flush=True)

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return adamw_with_warmup(self, h.lr, h.weight_decay, h.adam_betas, h.adam_eps, h.warmup_fraction,
                                 int(self.trainer.estimated_stepping_batches))
