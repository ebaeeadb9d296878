"""Hugging Face Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Phi-3 / Gemma / Gemma 2 / Gemma 3 /
OLMo-2 / OLMo-3 checkpoints in and out of a ``LlamaModel`` at any TP/PP/EP layout.

Qwen2 is a Llama with biases on the query/key/value projections (``add_qkv_bias``), laid out as the weights'
rows; Qwen3 one with RMSNorms over each head's queries and keys (``qk_layernorm``). Their sliding windows
(``use_sliding_window``) cover the layers from ``max_window_layers`` on, or those ``layer_types`` names. Phi-3 fuses
q/k/v into one ``qkv_proj`` (all query rows, then key, then
value) and gate/up into ``gate_up_proj``: segments of one tensor, read the same way. Gemma (v1) is a Llama with
a GeGLU MLP (``activation="geglu"``), norms that scale by ``1 + weight`` (``layernorm_zero_centered_gamma``: the
weights load unchanged) and word embeddings times ``sqrt(hidden_size)`` (``embedding_multiplier``). Qwen3-MoE is
a Qwen3 whose every MLP is a mixture of experts (router ``mlp.gate``, experts ``mlp.experts.<e>.gate_proj/up_proj/
down_proj``; ``norm_topk_prob=false`` keeps the top-k of a softmax over all experts: ``pre_softmax=True``).
Qwen2-MoE is a Qwen2 (q/k/v biases, unless ``qkv_bias=false``) whose MLPs are Qwen3-MoE's experts plus a shared
expert (``mlp.shared_expert``, our ``shared_experts``) gated per token by ``sigmoid(mlp.shared_expert_gate(x))``
(``MoEConfig.shared_expert_gate``). Gemma 2 is a Gemma whose layers norm before and after each sub-block
(``layernorm_order="sandwich"``: ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``), soft-caps its attention scores and output logits, scales the scores by
``query_pre_attn_scalar ** -0.5`` and windows the layers ``layer_types`` marks ``sliding_attention``. OLMo-2 is a
Llama whose norms sit on each sub-block's output only (``"post_sublayer"``) and whose q/k RMSNorms span all heads
(``qk_layernorm_across_heads``: weights of ``heads * head_dim``, read whole by every tp rank). Gemma 3 (text) is a
Gemma 2 with per-head q/k norms and no soft-caps by default, whose windowed layers rotate by their own base
(``window_rotary_base``); OLMo-3 is an OLMo-2 with such windows and bases. A multimodal Gemma 3 checkpoint
(``model_type="gemma3"``) imports its language model alone (``text_config``; tensors named ``language_model.*``) and
exports it as ``gemma3_text``.

Balancing loss of the MoE families: transformers adds ``router_aux_loss_coef`` times its ``load_balancing_loss_func``
(pooled over all layers' router logits) to the training loss only with ``output_router_logits=true``. The import
does the same: that coefficient with ``aux_loss_type="hf_pooled"`` (``moe.pooled_aux_loss``), so a training step
equals transformers' own; with ``output_router_logits=false`` no balancing loss. Megatron's per-layer loss stays the
default of native models (``MoEConfig``); pass ``config_overrides={"moe": MoEConfig(...)}`` to train an import with it.

Import (``load_hf_llama``, ``llama_from_hf``): every rank opens the safetensors files (one
``model.safetensors`` or the shards of ``model.safetensors.index.json``) and reads, with
``safe_open(...).get_slice``, only the rows (or columns) of the tensors its own parameters hold:
its stage's layers, its tp slice of every head / MLP unit / vocabulary row, its ep share of the
experts. Our full (TP=1) tensors are described as row-wise concatenations of Hugging Face
tensors (the fused Q/K/V head by head, the GQA key/value weight group by group, SwiGLU's gate
then up, the vocabulary padded with zero rows), so a rank's slice of a full tensor is a few
contiguous reads.

Export (``save_hf_llama``, collective): the pipeline stages take turns; within a stage every
parameter is gathered to its full tensor (over tp, and over etp and ep for experts), converted to
Hugging Face tensors, and one writer rank per stage streams them to global rank 0, which writes
safetensors files of at most ``max_shard_size`` (plus ``model.safetensors.index.json`` when there
is more than one) and ``config.json``. Rank 0 holds at most one file's tensors at a time; the
other ranks one parameter's.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import get_parallel_state
from ..tensor_parallel.mappings import gather_along_dim
from ..transformer import TransformerConfig
from .gpt import GPTModel
from .llama import LlamaModel
from .hf_config import (  # noqa: F401  (the configuration's names, public here as before)
    ARCHITECTURES, FUSED_FAMILIES, GEMMA_ACTIVATION, GEMMA_FAMILIES, MOE_FAMILIES, MOE_NAMES, QK_NORM_FAMILIES,
    QKV_BIAS_FAMILIES, QWEN_MOE_FAMILIES, SHARED_EXPERT, TENSOR_PREFIX, WINDOWED_FAMILIES, _fused, _moe_family,
    config_from_hf,
    hf_config_of, model_kwargs_from_hf, read_hf_config,
)
from .sharding import full_of, global_names

if TYPE_CHECKING:
    from ..moe.experts import GroupedMLP

Segments = List[Tuple[Optional[str], int, int]]   # (HF name or None for zeros, first row, end row)
# a layer's norms (ours -> Hugging Face's) by TransformerConfig.layernorm_order: Llama's second norm is before the MLP
_LAYER_NORMS: Dict[str, Dict[str, str]] = {
    "pre": {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {"attention_norm": "input_layernorm", "attention_output_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_output_norm": "post_feedforward_layernorm"},
    "post_sublayer": {"attention_output_norm": "post_attention_layernorm",
                      "mlp_output_norm": "post_feedforward_layernorm"},
}



# -- reading slices ----------------------------------------------------------------------------------


class SafetensorsSlices:
    """Lazy, slice-wise access to a directory's safetensors (single file or sharded with an index). ``prefix``:
    only the tensors named with it, known by the rest of their names (a multimodal checkpoint's language model)."""

    def __init__(self, path: Union[str, os.PathLike], prefix: str = "") -> None:
        from safetensors import safe_open

        self._open = safe_open
        path = os.fspath(path)
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}.")
        self.stored = {name[len(prefix):]: name for name in self.files if name.startswith(prefix)}
        self.files = {short: self.files[name] for short, name in self.stored.items()}
        self._handles: Dict[str, Any] = {}
        self.elements_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(file, framework="pt")
        return self._handles[file].get_slice(self.stored[name])

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, *index: slice) -> torch.Tensor:
        part = self._slice(name)
        tensor = part[index] if index else part[:]
        self.elements_read += tensor.numel()
        return tensor

    def close(self) -> None:
        self._handles.clear()


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def expected_hf_shapes(model: GPTModel, reader: Optional[SafetensorsSlices] = None) -> Dict[str, Tuple[int, ...]]:
    """Hugging Face tensor name → shape for ``model``'s configuration (every layer, every expert)."""
    c = model.config
    h, d, heads, groups, ffn = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_hidden_size
    assert ffn is not None   # TransformerConfig.__post_init__ filled it
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,)}
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    for i in range(c.num_layers):
        p = _hf_layer(i)
        if _fused(model):
            shapes[p + "self_attn.qkv_proj.weight"] = ((heads + 2 * groups) * d, h)
        else:
            shapes.update({p + "self_attn.q_proj.weight": (heads * d, h),
                           p + "self_attn.k_proj.weight": (groups * d, h),
                           p + "self_attn.v_proj.weight": (groups * d, h)})
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * d)
        shapes.update({p + norm + ".weight": (h,) for norm in _LAYER_NORMS.get(c.layernorm_order, {}).values()})
        if c.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (heads * d,), p + "self_attn.k_proj.bias": (groups * d,),
                           p + "self_attn.v_proj.bias": (groups * d,)})
        if c.qk_layernorm:   # one weight of d shared by the heads, or (across heads) d per head
            across = c.qk_layernorm_across_heads
            shapes.update({p + "self_attn.q_norm.weight": (heads * d if across else d,),
                           p + "self_attn.k_norm.weight": (groups * d if across else d,)})
        if c.is_moe_layer(i + 1):
            m = c.moe
            assert m is not None   # is_moe_layer
            f = m.ffn_hidden_size
            router, expert, (gate, up, down) = MOE_NAMES[_moe_family(model)]
            shapes[p + router] = (m.num_experts, h)
            for e in range(m.num_experts):
                q = p + expert.format(e=e)
                shapes.update({q + f"{gate}.weight": (f, h), q + f"{up}.weight": (f, h), q + f"{down}.weight": (h, f)})
            if m.shared_expert_ffn_hidden_size:
                q, g = p + SHARED_EXPERT, m.shared_expert_ffn_hidden_size
                shapes.update({q + "gate_proj.weight": (g, h), q + "up_proj.weight": (g, h), q + "down_proj.weight": (h, g)})
            if m.shared_expert_gate:
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        elif _fused(model):
            shapes.update({p + "mlp.gate_up_proj.weight": (2 * ffn, h), p + "mlp.down_proj.weight": (h, ffn)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                           p + "mlp.down_proj.weight": (h, ffn)})
    return shapes


def _segments(name: str, model: GPTModel) -> Tuple[Segments, int]:
    """Our full tensor ``name`` as row segments of HF tensors, and the dim those rows run along
    (0, or 1 for the row-parallel weights, whose columns are split)."""
    c = model.config
    d, heads, groups = c.head_dim, c.num_attention_heads, c.query_groups
    assert c.ffn_hidden_size is not None   # TransformerConfig.__post_init__ filled it
    vocab_rows: Segments = ([(None, 0, model.padded_vocab_size - model.vocab_size)]
                            if model.padded_vocab_size > model.vocab_size else [])
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", 0, model.vocab_size)] + vocab_rows, 0
    if name == "output_weight":
        source = "model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
        return [(source, 0, model.vocab_size)] + vocab_rows, 0
    if name == "decoder.final_norm.weight":
        return [("model.norm.weight", 0, c.hidden_size)], 0
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"model parameter {name!r} has no Hugging Face Llama counterpart.")
    p, rest = _hf_layer(int(match[1])), match[2]
    attn = p + "self_attn."
    if _fused(model):
        fused = _fused_segments(rest, attn, p, c)
        if fused is not None:
            return fused
    kind = rest.rsplit(".", 1)[-1]   # the projections' weights and (Qwen2) biases share their row layout
    if rest in ("attention.qkv.weight", "attention.qkv.bias"):   # head by head: [q_i; k_i; v_i]
        return [(f"{attn}{x}_proj.{kind}", i * d, (i + 1) * d) for i in range(heads) for x in "qkv"], 0
    if rest in ("attention.q.weight", "attention.q.bias"):
        return [(f"{attn}q_proj.{kind}", 0, heads * d)], 0
    if rest in ("attention.kv.weight", "attention.kv.bias"):   # group by group: [k_g; v_g]
        return [(f"{attn}{x}_proj.{kind}", g * d, (g + 1) * d) for g in range(groups) for x in "kv"], 0
    if rest in ("attention.q_norm.weight", "attention.k_norm.weight"):   # one weight for every head, or per channel
        which = rest.split(".")[1]
        width = (heads if which == "q_norm" else groups) * d if c.qk_layernorm_across_heads else d
        return [(f"{attn}{which}.weight", 0, width)], 0
    if rest == "attention.proj.weight":
        return [(attn + "o_proj.weight", 0, heads * d)], 1
    norm = _LAYER_NORMS.get(c.layernorm_order, {}).get(rest.removesuffix(".weight"))
    if norm is not None and rest.endswith(".weight"):
        return [(p + norm + ".weight", 0, c.hidden_size)], 0
    if rest == "mlp.fc1.weight":        # SwiGLU: gate then up
        return [(p + "mlp.gate_proj.weight", 0, c.ffn_hidden_size), (p + "mlp.up_proj.weight", 0, c.ffn_hidden_size)], 0
    if rest == "mlp.fc2.weight":
        return [(p + "mlp.down_proj.weight", 0, c.ffn_hidden_size)], 1
    if rest == "mlp.router.weight":
        assert c.moe is not None   # only MoE layers have a router
        return [(p + MOE_NAMES[_moe_family(model)][0], 0, c.moe.num_experts)], 0
    if rest.startswith("mlp.shared_expert"):   # Qwen2-MoE: a SwiGLU MLP (gate then up, down) and its [1, h] gate
        assert c.moe is not None and c.moe.shared_expert_ffn_hidden_size   # only such layers have these
        g, q = c.moe.shared_expert_ffn_hidden_size, p + SHARED_EXPERT
        if rest == "mlp.shared_experts.fc1.weight":
            return [(q + "gate_proj.weight", 0, g), (q + "up_proj.weight", 0, g)], 0
        if rest == "mlp.shared_experts.fc2.weight":
            return [(q + "down_proj.weight", 0, g)], 1
        if rest == "mlp.shared_expert_gate.weight":
            return [(p + "mlp.shared_expert_gate.weight", 0, 1)], 0
    raise KeyError(f"model parameter {name!r} has no Hugging Face Llama counterpart.")


def _fused_segments(rest: str, attn: str, p: str, c: TransformerConfig) -> Optional[Tuple[Segments, int]]:
    """Phi-3's fused tensors: ``qkv_proj`` rows are all query heads, then all key heads, then all value heads;
    ``gate_up_proj`` is gate then up, our ``fc1`` exactly."""
    d, heads, groups = c.head_dim, c.num_attention_heads, c.query_groups
    q0, k0, v0 = 0, heads * d, (heads + groups) * d
    qkv = attn + "qkv_proj.weight"
    if rest == "attention.qkv.weight":   # ours head by head: [q_i; k_i; v_i]
        return [(qkv, start + i * d, start + (i + 1) * d) for i in range(heads) for start in (q0, k0, v0)], 0
    if rest == "attention.q.weight":
        return [(qkv, q0, k0)], 0
    if rest == "attention.kv.weight":    # ours group by group: [k_g; v_g]
        return [(qkv, start + g * d, start + (g + 1) * d) for g in range(groups) for start in (k0, v0)], 0
    if rest == "mlp.fc1.weight":
        assert c.ffn_hidden_size is not None   # TransformerConfig.__post_init__ filled it
        return [(p + "mlp.gate_up_proj.weight", 0, 2 * c.ffn_hidden_size)], 0
    return None


def _expert_segments(name: str, expert: int, model: GPTModel) -> Tuple[Segments, int]:
    """One expert's slice of ``weight1`` ([gate; up] = [w1; w3]) or ``weight2`` (w2, columns split)."""
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.(weight[12])", name)
    moe = model.config.moe
    assert match is not None and moe is not None   # the caller passes MoE layers' expert weights
    layer, which = match.groups()
    f = moe.ffn_hidden_size
    _, prefix, (gate, up, down) = MOE_NAMES[_moe_family(model)]
    q = _hf_layer(int(layer)) + prefix.format(e=expert)
    if which == "weight1":
        return [(q + f"{gate}.weight", 0, f), (q + f"{up}.weight", 0, f)], 0
    return [(q + f"{down}.weight", 0, f)], 1


def _read_range(reader: SafetensorsSlices, segments: Segments, dim: int, start: int, stop: int,
                like: torch.Tensor) -> torch.Tensor:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of the full tensor ``segments`` describe."""
    pieces, pos = [], 0
    for source, first, end in segments:
        lo, hi = max(start, pos), min(stop, pos + end - first)
        if lo < hi:
            a, b = first + lo - pos, first + hi - pos
            if source is None:
                shape = list(like.shape)
                shape[dim] = b - a
                pieces.append(torch.zeros(shape, dtype=like.dtype))
            else:
                index = (slice(a, b),) if dim == 0 else (slice(None), slice(a, b))
                pieces.append(reader.read(source, *index))
        pos += end - first
    return torch.cat(pieces, dim=dim)


def _local_ranges(length: int, rank: int, size: int, stride: int) -> List[Tuple[int, int]]:
    """The index ranges of a full dim of ``length`` a rank holds (``shard_of``'s strided blocks)."""
    block = length // (size * stride)
    return [((k * size + rank) * block, (k * size + rank + 1) * block) for k in range(stride)]


def _read_local(reader: SafetensorsSlices, segments: Segments, dim: int, param: torch.Tensor, rank: int,
                size: int, param_dim: Optional[int] = None) -> torch.Tensor:
    """This rank's piece of a full tensor: its strided blocks along the partition dim, if split."""
    length = sum(end - first for _, first, end in segments)
    split = getattr(param, "tensor_model_parallel", False) and size > 1
    ranges = _local_ranges(length, rank, size, getattr(param, "partition_stride", 1)) if split else [(0, length)]
    like = param if param_dim is None else param[0]
    return torch.cat([_read_range(reader, segments, dim, a, b, like) for a, b in ranges], dim=dim)


def _check_shapes(reader: SafetensorsSlices, segments: Segments, expected: Dict[str, Tuple[int, ...]],
                  ours: str) -> None:
    for source, _, _ in segments:
        if source is None:
            continue
        if source not in reader:
            raise KeyError(f"{source!r} (for {ours}) is missing from the Hugging Face checkpoint.")
        if reader.shape(source) != expected[source]:
            raise ValueError(f"{source!r} has shape {reader.shape(source)} in the checkpoint but the model expects "
                             f"{expected[source]}; check that config.json matches the weights.")


# -- import ------------------------------------------------------------------------------------------


def gpt_chunks(module: nn.Module) -> List[GPTModel]:
    """The ``GPTModel`` chunks inside ``module`` (itself, a ``VirtualChunks``' chunks, a LightningModule's)."""
    chunks = [m for m in module.modules() if isinstance(m, GPTModel)]
    if not chunks:
        raise TypeError(f"{type(module).__name__} holds no GPTModel/LlamaModel.")
    return chunks


@torch.no_grad()
def load_hf_llama(module: nn.Module, path: Union[str, os.PathLike]) -> int:
    """Copy a Hugging Face Llama/Mistral/Mixtral directory's weights into the local shards of every
    ``LlamaModel`` chunk in ``module`` (every rank calls it; no communication). Each rank reads only
    the slices its parameters hold; returns how many elements it read."""
    state = get_parallel_state()
    hf_config = read_hf_config(path)
    reader = SafetensorsSlices(path, prefix=hf_config.get(TENSOR_PREFIX, ""))
    try:
        for chunk in gpt_chunks(module):
            chunk.hf_config = dict(hf_config)   # the family's tensor layout; the export keeps its other keys
            expected = expected_hf_shapes(chunk)
            names = global_names(chunk)
            for local_name, param in chunk.named_parameters():
                name = names[local_name]
                if local_name == "output_weight":
                    name = "output_weight"   # the untied output layer, or a last stage's tied copy
                if name.endswith(("mlp.experts.weight1", "mlp.experts.weight2")):
                    experts = cast("GroupedMLP", chunk.get_submodule(local_name.rsplit(".", 1)[0]))
                    tensors = []
                    for i in range(experts.num_local_experts):
                        segments, dim = _expert_segments(name, experts.first_expert + i, chunk)
                        _check_shapes(reader, segments, expected, name)
                        tensors.append(_read_local(reader, segments, dim, param, experts.etp_rank, experts.etp_size,
                                                   param_dim=0))
                    local = torch.stack(tensors)
                else:
                    segments, dim = _segments(name, chunk)
                    _check_shapes(reader, segments, expected, name)
                    local = _read_local(reader, segments, dim, param, state.tp_rank, state.tp_size)
                if local.shape != param.shape:
                    raise ValueError(f"{name}: the checkpoint gives this rank shape {tuple(local.shape)} but the "
                                     f"parameter is {tuple(param.shape)}; check that config.json matches the weights.")
                param.copy_(local.to(param.dtype))
    finally:
        reader.close()
    return reader.elements_read


def llama_from_hf(path: Union[str, os.PathLike], vp_rank: int = 0, config_overrides: Optional[dict] = None,
                  **model_kwargs: Any) -> LlamaModel:
    """Build chunk ``vp_rank`` of the ``LlamaModel`` of an HF directory for this rank and load its weights.
    Under virtual pipelining: ``VirtualChunks(lambda v: llama_from_hf(path, vp_rank=v))``."""
    config = config_from_hf(path, **(config_overrides or {}))
    kwargs = model_kwargs_from_hf(path)
    kwargs.update(model_kwargs)
    model = LlamaModel(config, vp_rank=vp_rank, **kwargs)
    load_hf_llama(model, path)
    return model


# -- export ------------------------------------------------------------------------------------------


def _full_tensor(param: torch.Tensor, state) -> torch.Tensor:
    """The single-process tensor of ``param`` (collective over tp, or etp then ep for experts)."""
    if getattr(param, "expert_parallel", False):
        etp = full_of(param.detach(), param, state.group("etp"))
        return gather_along_dim(etp.contiguous(), 0, state.group("ep"))
    return full_of(param.detach(), param, state.tp_group)


def _to_hf(name: str, full: torch.Tensor, model: GPTModel) -> Iterator[Tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs of our global ``name``'s full tensor."""
    if name == "output_weight" and model.tie_word_embeddings:
        return   # the last stage's copy of the tied table: HF ties lm_head itself
    if name.endswith(("mlp.experts.weight1", "mlp.experts.weight2")):
        for e in range(full.shape[0]):
            segments, dim = _expert_segments(name, e, model)
            yield from _split(segments, dim, full[e])
        return
    segments, dim = _segments(name, model)
    yield from _split(segments, dim, full)


def _split(segments: Segments, dim: int, full: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """Inverse of the segments: each HF tensor assembled from its rows of ``full``."""
    parts: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
    pos = 0
    for source, first, end in segments:
        if source is not None:
            parts.setdefault(source, []).append((first, full.narrow(dim, pos, end - first)))
        pos += end - first
    for source, pieces in parts.items():
        pieces.sort(key=lambda item: item[0])
        yield source, torch.cat([t for _, t in pieces], dim=dim)


def _stage_tensors(chunks: Sequence[GPTModel], state) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors, one parameter at a time (collectives inside: every rank of the stage)."""
    for chunk in chunks:
        names = global_names(chunk)
        for local_name, param in chunk.named_parameters():
            name = "output_weight" if local_name == "output_weight" else names[local_name]
            yield from _to_hf(name, _full_tensor(param, state), chunk)


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``5GB`` (10^9), ``5GiB`` (2^30), ``200MB``, ``20KB`` or an int (Hugging Face's convention)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: use bytes (an int) or a string such as '5GB' or '500MB'.")
    unit = match[2]
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    return int(float(match[1]) * (1024 if "I" in unit else 1000) ** power)


class _ShardWriter:
    """Rank 0's side of the export: fills safetensors files up to ``max_bytes`` and names them at the end."""

    def __init__(self, out_dir: str, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        os.makedirs(out_dir, exist_ok=True)
        for stale in os.listdir(out_dir):   # an earlier export's shards would mix into the index
            if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|\.export-\d+\.safetensors", stale):
                os.remove(os.path.join(out_dir, stale))
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: List[Tuple[str, List[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous().clone()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = f".export-{len(self.files)}.safetensors"
        save_file(self.pending, os.path.join(self.out_dir, file), metadata={"format": "pt"})
        self.files.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self, config: dict) -> None:
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (temp, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, temp), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        if n > 1:
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        with open(os.path.join(self.out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


@torch.no_grad()
def save_hf_llama(module: nn.Module, out_dir: Union[str, os.PathLike], max_shard_size: Union[int, str] = "5GB",
                  dtype: Optional[torch.dtype] = None, model_type: Optional[str] = None) -> None:
    """Write the ``LlamaModel`` in ``module`` (all its chunks, stages and shards) as a Hugging Face
    directory on global rank 0 (collective: every rank calls it).

    ``max_shard_size``: the largest safetensors file (bytes or ``"5GB"``); more than one file comes
    with ``model.safetensors.index.json``. ``dtype``: the tensors' dtype on disk (default: the
    parameters'). ``model_type``: one of ``ARCHITECTURES`` (default: the imported checkpoint's, else mixtral for
    MoE models, qwen3 / qwen2 for q/k norms / q/k/v biases, mistral with a window, llama otherwise); a type that
    does not describe the model is refused on every rank before anything is written.
    """
    state = get_parallel_state()
    chunks = gpt_chunks(module)
    # checked on every rank before any collective (every stage describes the same model): one error everywhere
    config = hf_config_of(chunks[-1], model_type, dtype, getattr(chunks[-1], "hf_config", None))
    rank = dist.get_rank()
    writer = state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0   # one rank per stage
    writers: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(writers, (state.pp_rank, rank) if writer else None)
    writer_of = {stage: r for stage, r in filter(None, writers)}
    sink = _ShardWriter(os.fspath(out_dir), parse_size(max_shard_size)) if rank == 0 else None
    device = next(chunks[0].parameters()).device
    for stage in range(state.pp_size):
        if state.pp_rank == stage:
            for hf_name, tensor in _stage_tensors(chunks, state):
                if not writer:
                    continue
                tensor = tensor.to(dtype or tensor.dtype).contiguous()
                if rank == 0:
                    assert sink is not None
                    sink.add(hf_name, tensor.cpu())
                else:
                    dist.send_object_list([(hf_name, tuple(tensor.shape), tensor.dtype)], dst=0)
                    dist.send(tensor, dst=0)
            if writer and rank != 0:
                dist.send_object_list([None], dst=0)
        elif rank == 0:
            src = writer_of[stage]
            while True:
                box = [None]
                dist.recv_object_list(box, src=src)
                if box[0] is None:
                    break
                hf_name, shape, tensor_dtype = box[0]
                buffer = torch.empty(shape, dtype=tensor_dtype, device=device)
                dist.recv(buffer, src=src)
                assert sink is not None
                sink.add(hf_name, buffer.cpu())
    if sink is not None:   # rank 0
        sink.finish(config)
    dist.barrier()
