"""Hugging Face ``config.json`` of the Llama-like families in and out of a ``TransformerConfig``: what each family's
keys mean here, and the checks that refuse (naming the key) what the blocks cannot reproduce exactly.

The tensors' side (names, slices, import and export) is ``hf_llama.py``; the families are described there too.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..transformer import TransformerConfig
from .gpt import GPTModel
from .llama import LLAMA_DEFAULTS

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "olmo2": "Olmo2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "olmo3": "Olmo3ForCausalLM"}
FUSED_FAMILIES = ("phi3",)       # one qkv_proj ([all q; all k; all v] rows) and one gate_up_proj ([gate; up])
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")   # biases on q/k/v only (Qwen2Attention; qwen2_moe: its qkv_bias)
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3_text")   # RMSNorms of queries and keys (q/k_norm)
ACROSS_HEADS_QK_NORM_FAMILIES = ("olmo2", "olmo3")   # ... over all heads' channels at once (the others: each head's)
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
QWEN_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")   # softmax over every expert, top-k renormalised with norm_topk_prob
# where each MoE family keeps a layer's router and experts, and its names of an expert's gate, up and down projections
MOE_NAMES = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
             "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
             "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))}
SHARED_EXPERT = "mlp.shared_expert."   # Qwen2-MoE's shared expert (gate/up/down_proj) and its gate
WINDOWED_FAMILIES = ("mistral", "mixtral", "phi3")   # sliding_window applies to every layer
QWEN_FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")   # windows (use_sliding_window) from max_window_layers on
# sliding_window on the layers whose layer_types entry is "sliding_attention" (each family's default when absent)
LAYER_TYPED_WINDOWS = ("gemma2", "gemma3_text", "olmo3") + QWEN_FAMILIES
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")   # GeGLU, norms scaling by 1 + weight, embeddings times sqrt(h)
SOFTCAPPED_FAMILIES = ("gemma2", "gemma3_text")   # query_pre_attn_scalar, attn_ and final_logit_softcapping
LOCAL_ROPE_FAMILIES = ("gemma3_text", "olmo3")   # rope_parameters per layer type: the windowed layers' own base
LAYERNORM_ORDERS = {"gemma2": "sandwich", "gemma3_text": "sandwich", "olmo2": "post_sublayer",
                    "olmo3": "post_sublayer"}   # else "pre"
WINDOW_LAYER_TYPES = ("sliding_attention", "full_attention")
# multimodal checkpoints whose language model imports alone: its model_type and its tensors' name prefix on disk (the
# vision tower is left out; the export is the language model, as that type)
MULTIMODAL_TEXT = {"gemma3": ("gemma3_text", "language_model.")}
TENSOR_PREFIX = "_lightning_megatron_tensor_prefix"   # in read_hf_config's dict of such a checkpoint
GEMMA_ACTIVATION = "gelu_pytorch_tanh"


# -- configuration -----------------------------------------------------------------------------------


def read_hf_config(source: Union[str, os.PathLike, dict, Any]) -> dict:
    """``config.json`` of a directory, a dict, or a ``transformers`` config object, as a dict; a multimodal
    checkpoint's (Gemma 3) as its language model's config, whose tensors carry ``TENSOR_PREFIX``."""
    if isinstance(source, dict):
        hf = dict(source)
    elif hasattr(source, "to_dict"):
        hf = source.to_dict()
    else:
        file = os.path.join(os.fspath(source), "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} not found: pass a Hugging Face Llama/Mistral/Mixtral directory "
                                    f"(config.json + safetensors).")
        with open(file) as f:
            hf = json.load(f)
    text = MULTIMODAL_TEXT.get(str(hf.get("model_type")))
    if text is None or not isinstance(hf.get("text_config"), dict):
        return hf
    out = dict(hf["text_config"], model_type=text[0], **{TENSOR_PREFIX: text[1]})
    if "tie_word_embeddings" in hf:   # the top level's (transformers reads it there for these models)
        out["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return out


def _rope(hf: dict) -> Tuple[float, Optional[dict]]:
    """(rope base, rope_scaling or None) from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` / ``rope_scaling`` keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    base = params.get("rope_theta", hf.get("rope_theta")) or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind   # Phi-3's first releases' name, read as longrope by transformers
    if kind == "default":
        return float(base), None
    params["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope", "dynamic"):
        params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings")
                          or hf.get("max_position_embeddings"))
    if kind in ("yarn", "longrope") and params.get("factor") is None:   # transformers: the context's growth
        params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    return float(base), params


def config_from_hf(source: Union[str, os.PathLike, dict, Any], **overrides: Any) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face Llama, Mistral or Mixtral config (directory, dict or
    ``transformers`` config); ``overrides`` replace any field (e.g. ``params_dtype``, ``recompute_layers``)."""
    hf = read_hf_config(source)
    model_type = hf.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r} in config.json is not supported; known: {sorted(ARCHITECTURES)}.")
    gemma = model_type in GEMMA_FAMILIES
    act = (hf.get("hidden_activation") or hf.get("hidden_act") or GEMMA_ACTIVATION) if gemma else hf.get(
        "hidden_act", "silu")
    if gemma and act == "gelu":   # the official releases' legacy value, meant (and read by transformers) as tanh
        act = GEMMA_ACTIVATION
    if gemma and act != GEMMA_ACTIVATION:
        raise ValueError(f"hidden_act={act!r} in config.json is not supported for Gemma: its GeGLU MLP is "
                         f"{GEMMA_ACTIVATION!r} (tanh-approximated GELU) here.")
    if not gemma and act != "silu":
        raise ValueError(f"hidden_act={act!r} in config.json is not supported: Llama-family MLPs are SwiGLU (silu).")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}=true in config.json is not supported (Llama-family layers have no biases).")
    rope_params = hf.get("rope_parameters") or {}
    if (rope_params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 in config.json is not supported for Llama-family models.")
    base, scaling = _rope(_global_rope(hf) if model_type in LOCAL_ROPE_FAMILIES else hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads = hf.get("num_key_value_heads") or heads
    fields = dict(
        LLAMA_DEFAULTS, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_query_groups=kv_heads if kv_heads != heads else None,
        kv_channels=head_dim if head_dim * heads != hf["hidden_size"] else None,
        ffn_hidden_size=hf["intermediate_size"], layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        attention_dropout=hf.get("attention_dropout", 0.0) or 0.0, init_method_std=hf.get("initializer_range", 0.02),
        rotary_base=base, rope_scaling=scaling,
        sliding_window=hf.get("sliding_window") if model_type in WINDOWED_FAMILIES else None,
        add_qkv_bias=True if model_type in QKV_BIAS_FAMILIES and hf.get("qkv_bias", True) else None,
        qk_layernorm=model_type in QK_NORM_FAMILIES,
        qk_layernorm_across_heads=model_type in ACROSS_HEADS_QK_NORM_FAMILIES,
        layernorm_order=LAYERNORM_ORDERS.get(model_type, "pre"),
    )
    if gemma:
        fields.update(activation="geglu", layernorm_zero_centered_gamma=True,
                      embedding_multiplier=float(hf["hidden_size"]) ** 0.5)
    if model_type in LAYER_TYPED_WINDOWS:
        fields.update(_typed_windows(hf, model_type))
    if model_type in LOCAL_ROPE_FAMILIES and fields.get("sliding_window") is not None:
        fields["window_rotary_base"] = _local_rope_base(hf)
    if model_type in SOFTCAPPED_FAMILIES:
        scalar = hf.get("query_pre_attn_scalar") or head_dim
        fields.update(softmax_scale=None if scalar == head_dim else scalar ** -0.5,
                      attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                      final_logit_softcapping=hf.get("final_logit_softcapping"))
    if model_type in QWEN_MOE_FAMILIES and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        raise ValueError(f"decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers="
                         f"{hf.get('mlp_only_layers')} in config.json (dense MLPs between the sparse ones) are not "
                         f"supported; every layer must be a mixture of experts (1 / []).")
    if model_type in MOE_FAMILIES:
        from ..moe import MoEConfig

        qwen = model_type in QWEN_MOE_FAMILIES
        shared = hf.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
        if model_type == "qwen2_moe" and not shared:
            raise ValueError(f"shared_expert_intermediate_size={shared} in config.json is not supported: Qwen2-MoE "
                             f"layers here have a shared expert of positive width.")
        fields["moe"] = MoEConfig(
            hidden_size=hf["hidden_size"], ffn_hidden_size=hf["moe_intermediate_size" if qwen else "intermediate_size"],
            # Qwen's releases say num_experts; transformers 5 writes num_local_experts for both families
            num_experts=hf.get("num_experts") or hf["num_local_experts"], topk=hf["num_experts_per_tok"],
            activation="swiglu", score_function="softmax",
            # top-k probabilities renormalised (Mixtral always, Qwen3-MoE with norm_topk_prob) = softmax over the
            # top-k logits; without: softmax over every expert, top-k kept as they are
            pre_softmax=qwen and not hf.get("norm_topk_prob", False), capacity_factor=None,
            shared_expert_ffn_hidden_size=shared, shared_expert_gate=bool(shared),
            # transformers' own loss, added only when it returns the router logits (see the module doc)
            aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0) if hf.get("output_router_logits") else 0.0,
            aux_loss_type="hf_pooled")
        fields["moe_layer_freq"] = 1
    fields.update(overrides)
    return TransformerConfig(**fields)


def _global_rope(hf: dict) -> dict:
    """Gemma 3's config with its full-attention layers' rope as the model's (``rope_parameters`` per layer type in
    transformers 5; ``rope_theta`` / ``rope_scaling`` before)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        return dict(hf, rope_parameters=params["full_attention"])
    return dict(hf, rope_theta=hf.get("rope_theta", 1_000_000.0))


def _local_rope_base(hf: dict) -> float:
    """The windowed layers' rotary base (Gemma 3: ``rope_local_base_freq``, 10000 by default; OLMo-3: the global one
    by default), refusing a scaling."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters['sliding_attention'] of rope_type {local['rope_type']!r} in config.json is "
                         f"not supported: the windowed layers here rotate without scaling.")
    default = hf.get("rope_local_base_freq", 10_000.0) if hf.get("model_type") == "gemma3_text" else _rope(
        _global_rope(hf))[0]
    return float(local.get("rope_theta", default))


def _default_layer_types(hf: dict, model_type: str, layers: int) -> List[str]:
    """transformers' default ``layer_types``: Gemma 2 alternates from a windowed first layer, Gemma 3 windows all but
    every ``sliding_window_pattern``-th (6; OLMo-3 every 4th), Qwen windows the layers from ``max_window_layers`` on."""
    sliding, full = WINDOW_LAYER_TYPES
    if model_type == "gemma2":
        return [sliding if i % 2 == 0 else full for i in range(layers)]
    if model_type in ("gemma3_text", "olmo3"):   # OLMo-3: every 4th layer full
        pattern = hf.get("sliding_window_pattern") or (6 if model_type == "gemma3_text" else 4)
        return [sliding if (i + 1) % pattern else full for i in range(layers)]
    first = hf.get("max_window_layers", layers)
    return [sliding if i >= first else full for i in range(layers)]


def _typed_windows(hf: dict, model_type: str) -> Dict[str, Any]:
    """``sliding_window`` and ``sliding_window_layers`` of a config whose ``layer_types`` say which layers have the
    window (each family's default when the key is absent; Qwen's only with ``use_sliding_window``)."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true in config.json is not supported: the language models here "
                         "are causal; import with use_bidirectional_attention=false.")
    if model_type in QWEN_FAMILIES and not hf.get("use_sliding_window"):
        return dict(sliding_window=None)
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or _default_layer_types(hf, model_type, layers)
    unknown = sorted(set(types) - set(WINDOW_LAYER_TYPES))
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types in config.json must give one of {list(WINDOW_LAYER_TYPES)} per layer "
                         f"(num_hidden_layers={layers}), got {types!r}.")
    windowed = [i + 1 for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not windowed or hf.get("sliding_window") is None:
        return dict(sliding_window=None)
    return dict(sliding_window=hf["sliding_window"],
                sliding_window_layers=None if len(windowed) == layers else windowed)


def model_kwargs_from_hf(source: Union[str, os.PathLike, dict, Any]) -> Dict[str, Any]:
    """``LlamaModel`` arguments besides the config: vocabulary, maximum length, tied embeddings."""
    hf = read_hf_config(source)
    return dict(vocab_size=hf["vocab_size"], max_sequence_length=hf.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def hf_config_of(model: GPTModel, model_type: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                 base: Optional[dict] = None) -> dict:
    """A Hugging Face ``config.json`` dict describing ``model`` (any chunk of it): ``base`` (the imported
    config, if any) with every structural key replaced by the model's own."""
    c = model.config
    if model_type is None:
        by_order = {"sandwich": "gemma3_text" if c.qk_layernorm else "gemma2",
                    "post_sublayer": "olmo3" if c.sliding_window else "olmo2"}
        model_type = (base or {}).get("model_type") or ("mixtral" if c.moe is not None else None) or \
            by_order.get(c.layernorm_order) or (
            "gemma" if c.layernorm_zero_centered_gamma else "qwen3" if c.qk_layernorm else "qwen2" if c.qkv_bias
            else "mistral" if c.sliding_window else "llama")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r} is not one of {sorted(ARCHITECTURES)}.")
    _check_layer_structure(c, model_type)
    if (c.qkv_bias != (model_type in QKV_BIAS_FAMILIES) and not (model_type == "qwen2_moe" and not c.qkv_bias)) \
            or c.add_bias_linear:
        described = "with" if model_type in QKV_BIAS_FAMILIES else "without"
        raise ValueError(f"model_type={model_type!r} describes a model {described} query/key/value biases and no "
                         f"other biases, but this model has add_qkv_bias="
                         f"{c.qkv_bias}, add_bias_linear={c.add_bias_linear}; use model_type='qwen2' for q/k/v "
                         f"biases or 'llama'/'mistral'/'mixtral'/'qwen3' for none.")
    if model_type in QWEN_MOE_FAMILIES and _moe_family(model) != model_type:
        raise ValueError(f"model_type={model_type!r} export needs a model imported from a {model_type} checkpoint (its "
                         f"expert names); export this one as 'mixtral'.")
    gated_shared = c.moe is not None and bool(c.moe.shared_expert_ffn_hidden_size) and c.moe.shared_expert_gate
    if c.moe is not None and (model_type == "qwen2_moe") != gated_shared:
        raise ValueError(f"model_type={model_type!r}: Qwen2-MoE (and only it) has a shared expert with a sigmoid gate, "
                         f"but this model has shared_expert_ffn_hidden_size={c.moe.shared_expert_ffn_hidden_size}, "
                         f"shared_expert_gate={c.moe.shared_expert_gate}.")
    if model_type in FUSED_FAMILIES and (not _fused(model) or c.query_groups != c.num_attention_heads):
        raise ValueError(f"model_type={model_type!r} export needs a model imported from a {model_type} checkpoint "
                         f"(its fused qkv_proj/gate_up_proj layout) with as many key/value heads as query heads; "
                         f"this one has {c.query_groups} of {c.num_attention_heads}: export as 'llama' instead.")
    if c.qk_layernorm != (model_type in QK_NORM_FAMILIES):
        raise ValueError(f"model_type={model_type!r} {'has' if model_type in QK_NORM_FAMILIES else 'has no'} query/key "
                         f"norms, but this model has qk_layernorm={c.qk_layernorm}; use model_type='qwen3' for "
                         f"query/key norms or another family for none.")
    gemma = (c.activation, c.layernorm_zero_centered_gamma, c.embedding_multiplier) == (
        "geglu", True, float(c.hidden_size) ** 0.5)
    if gemma != (model_type in GEMMA_FAMILIES) or (not gemma and (
            c.activation != "swiglu" or c.layernorm_zero_centered_gamma or c.embedding_multiplier != 1.0)):
        raise ValueError(f"model_type={model_type!r} describes a model with "
                         f"{'a GeGLU MLP, norms scaling by 1 + weight and embeddings times sqrt(hidden_size)' if model_type in GEMMA_FAMILIES else 'a SwiGLU MLP, plain norms and unscaled embeddings'}, "
                         f"but this model has activation={c.activation!r}, layernorm_zero_centered_gamma="
                         f"{c.layernorm_zero_centered_gamma}, embedding_multiplier={c.embedding_multiplier}; "
                         f"{'export as gemma' if gemma else 'no Hugging Face family here matches it'}.")
    rope = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_scaling is not None:
        rope.update(c.rope_scaling)
    out = dict(base or {})
    for stale in ("rope_scaling", "torch_dtype", "transformers_version", "_name_or_path", TENSOR_PREFIX):
        out.pop(stale, None)
    out.update({
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": model.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.query_groups,
        "head_dim": c.head_dim, "hidden_act": GEMMA_ACTIVATION if gemma else "silu", "rms_norm_eps": c.layernorm_epsilon,
        "max_position_embeddings": model.max_sequence_length,
        "rope_parameters": rope, "rope_theta": c.rotary_base, "initializer_range": c.init_method_std,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": bool(model.tie_word_embeddings),
        "dtype": str(dtype or c.params_dtype).replace("torch.", ""),
    })
    if c.rope_scaling is not None:   # transformers 4.x reads this key (5.x reads either; they agree)
        out["rope_scaling"] = dict(c.rope_scaling)
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif model_type in ("gemma2", "gemma3_text"):
        out.update(_gemma2_keys(c))
        out.pop("hidden_activation", None)
    elif model_type == "olmo3":
        out.update(attention_bias=False, sliding_window=c.sliding_window,
                   layer_types=[WINDOW_LAYER_TYPES[0 if c.window_of(n) is not None else 1]
                                for n in range(1, c.num_layers + 1)])
    elif model_type == "olmo2":
        if c.sliding_window:
            raise ValueError("model_type='olmo2' has no sliding window; export with sliding_window=None.")
        out.update(attention_bias=False)
    elif model_type == "gemma":
        if c.sliding_window:
            raise ValueError("model_type='gemma' has no sliding window; export with sliding_window=None.")
        out.update(attention_bias=False)
        out.pop("hidden_activation", None)   # older configs' key for the same activation
    elif model_type in QWEN_FAMILIES:
        windowed = [n for n in range(1, c.num_layers + 1) if c.window_of(n) is not None]
        out.update(use_sliding_window=bool(windowed), sliding_window=c.sliding_window if windowed else None,
                   max_window_layers=windowed[0] - 1 if windowed else c.num_layers,
                   layer_types=[WINDOW_LAYER_TYPES[0 if n in windowed else 1] for n in range(1, c.num_layers + 1)])
        if model_type in ("qwen3", "qwen3_moe"):
            out.update(attention_bias=False)
    else:
        out["sliding_window"] = c.sliding_window
    if model_type in LOCAL_ROPE_FAMILIES:   # rope_parameters per layer type
        local = c.window_rotary_base or c.rotary_base
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": local}})
        if model_type == "gemma3_text":
            out["rope_local_base_freq"] = local
    if model_type in MOE_FAMILIES and c.moe is None:
        raise ValueError(f"model_type={model_type!r} describes a mixture-of-experts model, but this model has no "
                         f"TransformerConfig.moe; use model_type='llama' or 'mistral'.")
    if model_type not in MOE_FAMILIES and c.moe is not None:
        raise ValueError(f"model_type={model_type!r} has no mixture-of-experts layers, but this model has "
                         f"TransformerConfig.moe; use model_type='mixtral' (or 'qwen3_moe' for an imported one).")
    moe = c.moe
    if model_type == "mixtral":
        assert moe is not None   # refused above
        out.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.topk, intermediate_size=moe.ffn_hidden_size)
    elif model_type in QWEN_MOE_FAMILIES:
        assert moe is not None   # refused above
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.topk, moe_intermediate_size=moe.ffn_hidden_size,
                   norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1, mlp_only_layers=[])
        if model_type == "qwen2_moe":
            out.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, qkv_bias=bool(c.qkv_bias))
    return out


def _check_layer_structure(c: TransformerConfig, model_type: str) -> None:
    """Refuse, before anything is written, a model_type whose layers differ from the model's: norm placement, the
    query/key norms' span, soft-capping and scale, per-layer windows."""
    order = LAYERNORM_ORDERS.get(model_type, "pre")
    if c.layernorm_order != order:
        families = sorted(f for f, o in LAYERNORM_ORDERS.items() if o == c.layernorm_order)
        raise ValueError(f"model_type={model_type!r} has layernorm_order={order!r} layers, but this model has "
                         f"layernorm_order={c.layernorm_order!r}; export as {families or 'another family'}.")
    across = model_type in ACROSS_HEADS_QK_NORM_FAMILIES
    if c.qk_layernorm and c.qk_layernorm_across_heads != across:
        span = "over all heads at once" if across else "per head"
        raise ValueError(f"model_type={model_type!r} normalizes queries and keys {span}, "
                         f"but this model has qk_layernorm_across_heads={c.qk_layernorm_across_heads}.")
    variants = {name: getattr(c, name) for name in ("softmax_scale", "attn_logit_softcapping",
                                                    "final_logit_softcapping") if getattr(c, name) is not None}
    if variants and model_type not in SOFTCAPPED_FAMILIES:
        raise ValueError(f"model_type={model_type!r} has no {sorted(variants)}, but this model sets {variants}; export "
                         f"as {list(SOFTCAPPED_FAMILIES)}.")
    if c.window_rotary_base is not None and model_type not in LOCAL_ROPE_FAMILIES:
        raise ValueError(f"model_type={model_type!r} has one rotary base, but this model has window_rotary_base="
                         f"{c.window_rotary_base}; export as {list(LOCAL_ROPE_FAMILIES)}.")
    if c.sliding_window_layers is not None and model_type not in LAYER_TYPED_WINDOWS:
        raise ValueError(f"model_type={model_type!r} has no per-layer windows, but this model has "
                         f"sliding_window_layers={c.sliding_window_layers}; export as {list(LAYER_TYPED_WINDOWS)}.")


def _gemma2_keys(c: TransformerConfig) -> Dict[str, Any]:
    """Gemma 2's attention keys: the scale as ``query_pre_attn_scalar`` (an integer when it is one), the soft-caps,
    and ``layer_types`` (which layers have the window)."""
    scalar: float = c.head_dim if c.softmax_scale is None else c.softmax_scale ** -2
    if abs(scalar - round(scalar)) < 1e-6 * scalar:
        scalar = int(round(scalar))
    windowed = [c.window_of(n) is not None for n in range(1, c.num_layers + 1)]
    return dict(query_pre_attn_scalar=scalar, attn_logit_softcapping=c.attn_logit_softcapping,
                final_logit_softcapping=c.final_logit_softcapping, attention_bias=False,
                sliding_window=c.sliding_window, use_bidirectional_attention=False,
                layer_types=[WINDOW_LAYER_TYPES[0] if w else WINDOW_LAYER_TYPES[1] for w in windowed])


def _moe_family(model: GPTModel) -> str:
    """Whose names a mixture-of-experts model's router and experts take: its checkpoint's family, else Mixtral's."""
    family = (getattr(model, "hf_config", None) or {}).get("model_type")
    return family if family in MOE_NAMES else "mixtral"


def _fused(model: GPTModel) -> bool:
    """Whether the model came from (or exports to) a family whose projections Hugging Face fuses (Phi-3)."""
    return (getattr(model, "hf_config", None) or {}).get("model_type") in FUSED_FAMILIES
