"""Pre-training a Llama (RoPE, grouped-query attention, SwiGLU, RMSNorm, untied output) on token files."""

from __future__ import annotations

import math
from typing import List, Optional, Union

import torch

from ...models.llama import LlamaModel, llama_config
from ...transformer import TransformerConfig
from .base import PretrainingModule, masked_mean

IGNORE_INDEX = -100


class LlamaPretraining(PretrainingModule):
    """Next-token prediction with ``LlamaModel``; the loss is the mean over the tokens that have a label
    (packed rows mark padding and document ends with -100): set ``calculate_per_token_loss: true`` on the
    strategy to make it the mean over the global batch's labelled tokens (else each micro-batch's mean,
    averaged). Hyper-parameters are LightningCLI arguments;
    ``lr`` warms up over ``warmup_steps`` and decays on a cosine to ``min_lr`` at ``trainer.max_steps``.
    ``cross_entropy_chunk_size``: compute the loss fused with the output layer, that many tokens at a time, so the
    float32 logits are never whole (``GPTModel``'s argument; None: unfused). ``pipeline_layout``: which layers
    each pipeline stage holds (``GPTModel``'s argument; None: balanced by cost)."""

    model_class = LlamaModel

    def __init__(self, vocab_size: int = 512, seq_length: int = 128, num_layers: int = 4, hidden_size: int = 64,
                 num_attention_heads: int = 4, num_query_groups: Optional[int] = 2,
                 ffn_hidden_size: Optional[int] = None, rotary_base: float = 10000.0,
                 sequence_parallel: bool = False, lr: float = 3e-3, min_lr: float = 3e-4, weight_decay: float = 0.01,
                 warmup_steps: int = 10, init_seed: int = 1234, cross_entropy_chunk_size: Optional[int] = None,
                 pipeline_layout: Union[None, str, List[int]] = None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def transformer_config(self) -> TransformerConfig:
        h = self.hparams
        return llama_config(h.num_layers, h.hidden_size, h.num_attention_heads, num_query_groups=h.num_query_groups,
                            ffn_hidden_size=h.ffn_hidden_size, rotary_base=h.rotary_base,
                            sequence_parallel=h.sequence_parallel, init_seed=h.init_seed)

    def forward(self, batch: dict) -> torch.Tensor:
        """Per-token losses ``[b, s]`` (0 where the label is -100). Packed rows (``PretrainingData(packed=True)``)
        bring ``position_ids`` restarting per document and ``document_ids``: attention stays in each document."""
        return self.model(batch["input_ids"], position_ids=batch.get("position_ids"), labels=batch["labels"],
                          document_ids=batch.get("document_ids"))

    def _loss(self, batch: dict) -> torch.Tensor:
        return masked_mean(self(batch), (batch["labels"] != IGNORE_INDEX).float())

    def training_step(self, batch: dict, batch_idx: int) -> Union[torch.Tensor, dict]:
        return self.token_loss(self(batch), (batch["labels"] != IGNORE_INDEX).float())

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def on_fit_end(self) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        if self.trainer.is_global_zero:
            print("final " + " ".join(f"{k}={v:.6f}" for k, v in sorted(metrics.items())), flush=True)

    def configure_optimizers(self):
        h = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=h.weight_decay, betas=(0.9, 0.95))
        total = max(1, self.trainer.max_steps) if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        warmup = max(1, h.warmup_steps)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if total is None or total <= warmup:
                return 1.0
            progress = min(1.0, (step - warmup) / (total - warmup))
            return (h.min_lr + (h.lr - h.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / h.lr

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
