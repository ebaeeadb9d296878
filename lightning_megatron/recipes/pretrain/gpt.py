"""A GPT pre-training LightningModule, and a synthetic token data module to try it on a laptop.

Ordinary Lightning: the model is built in ``configure_model`` (the parallel process groups
exist only then), ``training_step`` returns the loss. Under ``strategy="megatron"`` the same
module runs with any TP/PP/VPP/DP layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from ...models import GPTModel
from ...moe import MoEConfig
from ...transformer import TransformerConfig
from .base import PretrainingModule

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict


class GPTPretraining(PretrainingModule):
    """Next-token prediction with ``GPTModel``; hyper-parameters are LightningCLI arguments."""

    model_class = GPTModel

    def __init__(self, vocab_size: int = 128, seq_length: int = 32, num_layers: int = 4, hidden_size: int = 64,
                 num_attention_heads: int = 4, ffn_hidden_size: Optional[int] = None, dropout: float = 0.0,
                 activation: str = "gelu", normalization: str = "LayerNorm", sequence_parallel: bool = False,
                 lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 10,
                 init_seed: int = 1234, moe: Optional[MoEConfig] = None, moe_layer_freq: int = 1,
                 cross_entropy_chunk_size: Optional[int] = None,
                 pipeline_layout: Union[None, str, List[int]] = None) -> None:
        """``moe``: make every ``moe_layer_freq``-th MLP a mixture of experts (its ``hidden_size`` must
        equal ``hidden_size``); the strategy's ``expert_model_parallel_size`` spreads the experts.
        ``cross_entropy_chunk_size``: compute the loss fused with the output layer, that many tokens at a
        time, so the float32 logits are never whole (``GPTModel``'s argument; None: unfused).
        ``pipeline_layout``: which layers each pipeline stage holds (``GPTModel``'s; None: balanced by cost)."""
        super().__init__()
        self.save_hyperparameters()

    def transformer_config(self) -> TransformerConfig:
        h = self.hparams
        return TransformerConfig(
            num_layers=h.num_layers, hidden_size=h.hidden_size, num_attention_heads=h.num_attention_heads,
            ffn_hidden_size=h.ffn_hidden_size, hidden_dropout=h.dropout, attention_dropout=h.dropout,
            activation=h.activation, normalization=h.normalization, sequence_parallel=h.sequence_parallel,
            init_seed=h.init_seed, moe=_moe_config(h.moe), moe_layer_freq=h.moe_layer_freq)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["input_ids"], labels=batch["labels"])

    def training_step(self, batch: dict, batch_idx: int) -> Union[torch.Tensor, dict]:
        return self.token_loss(self(batch))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self(batch).mean(), prog_bar=True, sync_dist=True)

    def on_fit_end(self) -> None:
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        if self.trainer.is_global_zero:
            print("final " + " ".join(f"{k}={v:.6f}" for k, v in sorted(metrics.items())), flush=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = max(1, self.hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _moe_config(moe: Union[None, MoEConfig, Dict[str, Any]]) -> Optional[MoEConfig]:
    """LightningCLI records init arguments as given (``moe`` as a mapping); the model needs the dataclass."""
    return MoEConfig(**moe) if isinstance(moe, dict) else moe


class _Pattern(Dataset):
    def __init__(self, size: int, vocab_size: int, seq_length: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (size, 1), generator=gen)
        step = torch.randint(1, 4, (size, 1), generator=gen)
        self.tokens = (start + step * torch.arange(seq_length + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class PatternTokens(L.LightningDataModule):
    """Arithmetic token sequences (start + k·t mod V): learnable in a few hundred steps, no download."""

    if TYPE_CHECKING:   # what save_hyperparameters() stores: keys read as attributes (Lightning types it loosely)
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(self, vocab_size: int = 128, seq_length: int = 32, batch_size: int = 8, train_size: int = 2048,
                 val_size: int = 128, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(_Pattern(h.train_size, h.vocab_size, h.seq_length, h.seed), batch_size=h.batch_size,
                          shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(_Pattern(h.val_size, h.vocab_size, h.seq_length, h.seed + 1), batch_size=h.batch_size,
                          drop_last=True)
