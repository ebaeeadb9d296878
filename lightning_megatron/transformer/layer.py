"""One transformer layer: attention and MLP sub-blocks with residuals, pre- or post-norm."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from ..tensor_parallel import init_method_normal
from .attention import SelfAttention
from .config import TransformerConfig
from .documents import DocumentMask
from .mlp import MLP
from .norm import build_norm


def build_mlp(config: TransformerConfig, layer_number: int) -> nn.Module:
    """The dense MLP, or an MoE layer on the layers ``config.moe_layer_freq`` selects."""
    if config.moe is None or (layer_number - 1) % config.moe_layer_freq:
        return MLP(config)
    from ..moe import MoELayer   # the dense model does not need the MoE machinery

    moe = dataclasses.replace(config.moe, sequence_parallel=config.sequence_parallel)
    return MoELayer(moe, init_method=init_method_normal(config.init_method_std),
                    output_layer_init_method=init_method_normal(config.output_layer_init_std),
                    params_dtype=config.params_dtype)


def given(**inputs: Any) -> Dict[str, Any]:
    """The optional per-layer inputs that are not None, as keywords."""
    return {name: value for name, value in inputs.items() if value is not None}


class TransformerLayer(nn.Module):
    """``pre``: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))`` (seed 002, Fig. 7b).
    ``post`` (original BERT): ``norm(x + drop(attn(x)))`` then ``norm(x + drop(mlp(x)))``.

    ``mlp`` replaces the dense MLP (e.g. an MoE layer); it may return ``(output, extra)``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.pre_norm = config.layernorm_order == "pre"
        self.layer_number = layer_number
        self.attention_norm = build_norm(config)
        self.attention = SelfAttention(config, layer_number)
        self.mlp_norm = build_norm(config)
        self.mlp = mlp if mlp is not None else build_mlp(config, layer_number)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                document_ids: Union[torch.Tensor, DocumentMask, None] = None) -> torch.Tensor:
        # (hidden, mask) plus only the inputs given, by name: a per-layer CUDA graph replaces attention_block
        # with a (hidden, mask) call and refuses the others by their names
        return self.mlp_block(self.attention_block(hidden, attention_mask,
                                                   **given(position_ids=position_ids, document_ids=document_ids)))

    # The two sub-blocks are methods of their own so a per-layer CUDA graph can hold either one
    # (``cuda_graph_scope`` "attn" / "mlp", see ``lightning_megatron.cuda_graphs``).
    def attention_block(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                        position_ids: Optional[torch.Tensor] = None,
                        document_ids: Union[torch.Tensor, DocumentMask, None] = None) -> torch.Tensor:
        """``position_ids``: only for rotary embeddings, when not the tokens' global positions;
        ``document_ids``: packed documents, which attention does not cross."""
        inputs = (attention_mask, position_ids, document_ids)
        if self.pre_norm:
            return hidden + self.dropout(self.attention(self.attention_norm(hidden), *inputs))
        return self.attention_norm(hidden + self.dropout(self.attention(hidden, *inputs)))

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            return hidden + self.dropout(self._mlp(self.mlp_norm(hidden)))
        return self.mlp_norm(hidden + self.dropout(self._mlp(hidden)))
