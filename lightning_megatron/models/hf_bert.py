"""Hugging Face BERT directories in and out of a BertModel sharded for the current TP/PP layout.

Import: every rank reads the HF tensors, renames them to our global names, fuses Q/K/V head by
head, pads the vocabulary and copies its own shard. Export: every rank gathers its tp shards,
the first dp/cp replica of each stage sends them to rank 0, which writes one HF directory
(``config.json`` + ``model.safetensors``) that ``transformers.BertModel`` loads.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import get_parallel_state
from ..transformer import TransformerConfig
from .bert import BertForMaskedLM, BertForMultipleChoice, BertForSequenceClassification, BertModel
from .sharding import full_of, global_name, layer_index_maps, shard_of

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}

# our global name (inside BertModel) → HF name (inside HF BertModel); {i} is the layer index
_ENCODER = {
    "attention.proj.weight": "attention.output.dense.weight",
    "attention.proj.bias": "attention.output.dense.bias",
    "attention_norm.weight": "attention.output.LayerNorm.weight",
    "attention_norm.bias": "attention.output.LayerNorm.bias",
    "mlp.fc1.weight": "intermediate.dense.weight",
    "mlp.fc1.bias": "intermediate.dense.bias",
    "mlp.fc2.weight": "output.dense.weight",
    "mlp.fc2.bias": "output.dense.bias",
    "mlp_norm.weight": "output.LayerNorm.weight",
    "mlp_norm.bias": "output.LayerNorm.bias",
}
_EMBEDDING = {
    "embedding.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embedding.norm.weight": "embeddings.LayerNorm.weight",
    "embedding.norm.bias": "embeddings.LayerNorm.bias",
    "pooler.weight": "pooler.dense.weight",
    "pooler.bias": "pooler.dense.bias",
}
# heads of the task models: our name (outside ``bert.``) → HF name
_HEADS = {
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
    "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "lm_head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "lm_head.bias": "cls.predictions.bias",
}


# -- configuration -----------------------------------------------------------------------------------


def read_hf_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} not found: pass a Hugging Face BERT directory (config.json + weights).")
    with open(file) as f:
        return json.load(f)


def transformer_config_from_hf(hf: dict, **overrides) -> TransformerConfig:
    """The TransformerConfig of an HF BERT ``config.json`` (post-norm, padding mask, exact gelu)."""
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} in config.json is not supported; known: {sorted(_ACTIVATIONS)}.")
    kwargs = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1), attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        activation=_ACTIVATIONS[act], normalization="LayerNorm", layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
        layernorm_order="post", attn_mask_type="padding", init_method_std=hf.get("initializer_range", 0.02),
        scale_output_layer_init=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def hf_config_of(bert: BertModel) -> dict:
    """An HF ``config.json`` dict describing ``bert``."""
    c = bert.config
    act = {v: k for k, v in _ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}[c.activation]
    return {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": bert.vocab_size,
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "intermediate_size": c.ffn_hidden_size,
        "hidden_act": act, "hidden_dropout_prob": c.hidden_dropout,
        "attention_probs_dropout_prob": c.attention_dropout,
        "max_position_embeddings": bert.max_position_embeddings, "type_vocab_size": bert.type_vocab_size,
        "initializer_range": c.init_method_std, "layer_norm_eps": c.layernorm_epsilon, "pad_token_id": 0,
        "position_embedding_type": "absolute",
    }


# -- tensors -----------------------------------------------------------------------------------------


def read_hf_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """Tensors of ``model.safetensors`` (preferred) or ``pytorch_model.bin``, BERT prefix removed."""
    safetensors_file = os.path.join(path, "model.safetensors")
    bin_file = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(safetensors_file):
        from safetensors.torch import load_file
        tensors = load_file(safetensors_file)
    elif os.path.isfile(bin_file):
        tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}.")
    out = {}
    for name, tensor in tensors.items():
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[name[len("bert."):] if name.startswith("bert.") else name] = tensor
    return out


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Stack per head: rows ``[q_0 k_0 v_0 q_1 k_1 v_1 ...]`` so a tp shard holds whole heads."""
    return torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv: torch.Tensor, heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_head = qkv.reshape(heads, 3, -1, *qkv.shape[1:])
    q, k, v = (t.reshape(-1, *qkv.shape[1:]).contiguous() for t in per_head.unbind(1))
    return q, k, v


def _hf_name(name: str) -> Optional[str]:
    """HF name of one of our global BertModel names, or None for the fused qkv."""
    if name in _EMBEDDING:
        return _EMBEDDING[name]
    parts = name.split(".")
    if parts[:2] == ["encoder", "layers"]:
        rest = ".".join(parts[3:])
        if rest in _ENCODER:
            return f"encoder.layer.{parts[2]}.{_ENCODER[rest]}"
    return None


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def _expected(hf: Dict[str, torch.Tensor], hf_name: str, shape: torch.Size) -> torch.Tensor:
    if hf_name not in hf:
        raise KeyError(f"{hf_name!r} is missing from the Hugging Face checkpoint (expected shape {tuple(shape)}).")
    tensor = hf[hf_name]
    if tensor.shape != shape:
        raise ValueError(f"{hf_name!r} has shape {tuple(tensor.shape)} in the checkpoint but the model expects "
                         f"{tuple(shape)}; check that config.json matches the weights.")
    return tensor


def _full_tensor_from_hf(hf: Dict[str, torch.Tensor], name: str, bert: BertModel) -> Optional[torch.Tensor]:
    """The full (TP=1) tensor of our global ``name`` built from HF tensors; None if HF has none."""
    c = bert.config
    h = c.hidden_size
    parts = name.split(".")
    if parts[:2] == ["encoder", "layers"] and ".".join(parts[3:]) in ("attention.qkv.weight", "attention.qkv.bias"):
        kind = parts[-1]
        prefix = f"encoder.layer.{parts[2]}.attention.self"
        shape = torch.Size([h, h]) if kind == "weight" else torch.Size([h])
        q, k, v = (_expected(hf, f"{prefix}.{p}.{kind}", shape) for p in ("query", "key", "value"))
        return _fuse_qkv(q, k, v, c.num_attention_heads)
    hf_name = _hf_name(name)
    if hf_name is None:
        raise KeyError(f"model parameter {name!r} has no Hugging Face BERT counterpart.")
    if name == "embedding.word_embeddings.weight":
        return _pad_rows(_expected(hf, hf_name, torch.Size([bert.vocab_size, h])), bert.padded_vocab_size)
    return None if hf_name not in hf else hf[hf_name]


# -- import ------------------------------------------------------------------------------------------


def _bert_of(module: nn.Module) -> Tuple[BertModel, str]:
    if isinstance(module, BertModel):
        return module, ""
    bert = getattr(module, "bert", None)
    if not isinstance(bert, BertModel):
        raise TypeError(f"expected a BertModel or a model with a .bert BertModel, got {type(module).__name__}.")
    return bert, "bert."


@torch.no_grad()
def load_hf_bert(module: nn.Module, path: str, strict_heads: bool = False) -> None:
    """Copy an HF BERT directory's weights into ``module``'s local shards (every rank calls it).

    ``module`` is a ``BertModel`` or a task model holding one as ``.bert``; task heads found in
    the checkpoint (``classifier``, ``cls.predictions``) are loaded when their shapes match,
    otherwise they keep their fresh initialisation (fine-tuning), unless ``strict_heads``.
    """
    bert, prefix = _bert_of(module)
    hf = read_hf_state_dict(path)
    state = get_parallel_state()
    maps = layer_index_maps(bert)
    for local_name, param in bert.named_parameters():
        name = global_name(local_name, maps)
        full = _full_tensor_from_hf(hf, name, bert)
        if full is None:
            raise KeyError(f"{_hf_name(name)!r} (for {prefix}{name}) is missing from the Hugging Face checkpoint.")
        _copy_shard(param, full, f"{_hf_name(name) or 'q/k/v'!r} (for {prefix}{name})", state)
    for local_name, param in module.named_parameters():
        if local_name.startswith("bert.") or local_name not in _HEADS:
            continue
        hf_name = _HEADS[local_name]
        full = hf.get(hf_name)
        if local_name == "lm_head.bias" and full is not None:
            full = _pad_rows(full, bert.padded_vocab_size)
        expected = tuple(full_shape(param, state.tp_size))
        if full is None or tuple(full.shape) != expected:
            if strict_heads:
                got = None if full is None else tuple(full.shape)
                raise KeyError(f"head {hf_name!r}: checkpoint has {got}, the model expects {expected}.")
            continue
        _copy_shard(param, full, local_name, state)


def full_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size  # type: ignore[attr-defined]  # runtime attribute
    return torch.Size(shape)


def _copy_shard(param: torch.Tensor, full: torch.Tensor, name: str, state) -> None:
    expected = full_shape(param, state.tp_size)
    if full.shape != expected:
        raise ValueError(f"{name}: the checkpoint gives shape {tuple(full.shape)} but the model expects "
                         f"{tuple(expected)}; check that config.json matches the weights.")
    param.copy_(shard_of(full.to(param.dtype), param, state.tp_rank, state.tp_size))


_TASKS: Dict[str, Type[nn.Module]] = {
    "BertModel": BertModel, "BertForSequenceClassification": BertForSequenceClassification,
    "BertForMultipleChoice": BertForMultipleChoice, "BertForMaskedLM": BertForMaskedLM,
}


def bert_from_hf(path: str, task: str = "BertModel", config_overrides: Optional[dict] = None,
                 **model_kwargs) -> nn.Module:
    """Build ``task`` (``BertModel``, ``BertForSequenceClassification``, ...) for this rank's
    stage/shards from an HF directory and load its weights."""
    if task not in _TASKS:
        raise ValueError(f"task={task!r} is not one of {sorted(_TASKS)}.")
    hf = read_hf_config(path)
    config = transformer_config_from_hf(hf, **(config_overrides or {}))
    kwargs = dict(max_position_embeddings=hf.get("max_position_embeddings", 512),
                  type_vocab_size=hf.get("type_vocab_size", 2))
    kwargs.update(model_kwargs)
    model = _TASKS[task](config, hf["vocab_size"], **kwargs)
    load_hf_bert(model, path)
    return model


# -- export ------------------------------------------------------------------------------------------


@torch.no_grad()
def save_hf_bert(module: nn.Module, path: str) -> None:
    """Write ``module``'s BERT (and its heads) as one HF directory on global rank 0 (collective)."""
    bert, prefix = _bert_of(module)
    state = get_parallel_state()
    maps = layer_index_maps(bert)
    c = bert.config
    mine: Dict[str, torch.Tensor] = {}
    for local_name, param in module.named_parameters():
        if local_name == "output_weight":
            continue  # the last stage's twin of the tied word embeddings: HF ties them
        full = full_of(param.detach(), param, state.tp_group).cpu()
        if prefix and not local_name.startswith(prefix):
            if local_name not in _HEADS:
                raise KeyError(f"model parameter {local_name!r} has no Hugging Face BERT counterpart.")
            mine[_HEADS[local_name]] = full[:bert.vocab_size].clone() if local_name == "lm_head.bias" else full
            continue
        name = global_name(local_name[len(prefix):], maps)
        if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
            layer, kind = name.split(".")[2], name.rsplit(".", 1)[1]
            for part, tensor in zip(("query", "key", "value"), _split_qkv(full, c.num_attention_heads)):
                mine[f"encoder.layer.{layer}.attention.self.{part}.{kind}"] = tensor
            continue
        hf_name = _hf_name(name)
        if hf_name is None:
            raise KeyError(f"model parameter {local_name!r} has no Hugging Face BERT counterpart.")
        mine[hf_name] = full[:bert.vocab_size].clone() if name == "embedding.word_embeddings.weight" else full
    writer = state.dp_rank == 0 and state.cp_rank == 0 and state.tp_rank == 0
    gathered: Optional[List[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if writer else {}, gathered, dst=0)
    if gathered is not None:   # rank 0
        tensors: Dict[str, torch.Tensor] = {}
        for shard in gathered:
            tensors.update(shard)
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_config_of(bert), f, indent=2)
    dist.barrier()
