"""A tiny GPT in virtual pipeline chunks for the engine's tests (driven without Lightning)."""

from torch import nn

from lightning_megatron.models import GPTModel
from lightning_megatron.pipeline import VirtualChunks
from lightning_megatron.transformer import TransformerConfig
from helpers.strategy_utils import SEQ, VOCAB


class TinyLM(nn.Module):
    """4 layers of hidden 16; ``forward(batch)`` gives the per-token losses of ``batch["input_ids"]``/``["labels"]``
    (sequences up to ``max_seq`` tokens)."""

    def __init__(self, max_seq: int = SEQ):
        super().__init__()
        cfg = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                                attention_dropout=0.0)
        self.model = VirtualChunks(lambda vp_rank: GPTModel(cfg, VOCAB, max_seq, vp_rank=vp_rank))

    def forward(self, batch):
        return self.model(batch["input_ids"], labels=batch["labels"])
