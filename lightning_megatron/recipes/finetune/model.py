"""Build a BERT task model for this rank: from a Hugging Face directory, or randomly initialized.

Called from ``configure_model``, where the megatron strategy's process groups exist; each rank
builds only its tensor shards and pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from torch import nn

from ...models.bert import BertForMultipleChoice, BertForSequenceClassification
from ...models.hf_bert import bert_from_hf
from ...parallel import get_parallel_state, has_parallel_state
from ...transformer import TransformerConfig

TASKS = {"BertForSequenceClassification": BertForSequenceClassification,
         "BertForMultipleChoice": BertForMultipleChoice}


@dataclass
class BertShape:
    """A randomly initialized BERT, used when no pretrained directory is given.

    The defaults are a small model that trains on a CPU; BERT-large is ``num_layers=24,
    hidden_size=1024, num_attention_heads=16``. ``vocab_size=None`` takes the datamodule's
    tokenizer vocabulary. ``layernorm_order="pre"`` is Megatron's reordered layer (seed 002,
    Figure 7b), ``"post"`` the original BERT layer.
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    max_position_embeddings: int = 512
    layernorm_order: str = "pre"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_seed: int = 1234


def _parallel_overrides(overrides: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``config_overrides`` plus the strategy's sequence parallelism, which the blocks read from their config."""
    out = dict(overrides or {})
    if has_parallel_state():
        state = get_parallel_state()
        if getattr(state, "sequence_parallel", False) and state.tp_size > 1:
            out.setdefault("sequence_parallel", True)
    return out


def build_task_model(task: str, pretrained: Optional[str], shape: Optional[BertShape], vocab_size: Optional[int],
                     config_overrides: Optional[Dict[str, Any]] = None, **task_kwargs: Any) -> nn.Module:
    """``task`` (a class name of ``lightning_megatron.models``) from ``pretrained`` or ``shape``."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {sorted(TASKS)}.")
    if not has_parallel_state():
        raise RuntimeError("the BERT blocks need the megatron process groups: train with "
                           "Trainer(strategy='megatron'), or build a ParallelState and activate() it first.")
    overrides = _parallel_overrides(config_overrides)
    if pretrained is not None:
        return bert_from_hf(pretrained, task=task, config_overrides=overrides, **task_kwargs)
    shape = shape or BertShape()
    vocab = shape.vocab_size or vocab_size
    if vocab is None:
        raise ValueError("a randomly initialized BERT needs a vocabulary size: set random_init.vocab_size or use a "
                         "datamodule with a tokenizer (its vocab_size is used).")
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn_hidden_size, hidden_dropout=shape.hidden_dropout,
        attention_dropout=shape.attention_dropout, layernorm_order=shape.layernorm_order, attn_mask_type="padding",
        layernorm_epsilon=1e-12, init_seed=shape.init_seed, **overrides)
    return TASKS[task](config, vocab, max_position_embeddings=shape.max_position_embeddings, **task_kwargs)
