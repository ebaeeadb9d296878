"""The shape of a transformer and how it is initialised, checked once, with errors that say the fix."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")   # fc1 holds a gate and an up projection
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
LAYERNORM_ORDERS = ("pre", "post", "sandwich", "post_sublayer")   # see TransformerLayer
MASK_TYPES = ("causal", "padding")
POSITION_EMBEDDINGS = ("learned", "rope", "none")
DOCUMENT_ATTENTION = ("auto", "flex", "mask")   # kernels of attention within packed documents
# rope_scaling types and the keys each one needs (Hugging Face's ``rope_parameters`` names)
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    # Phi-3's LongRoPE: per-frequency factors, the long ones past the original context (rotary.py)
    "longrope": ("factor", "short_factor", "long_factor", "original_max_position_embeddings"),
    # dynamic NTK: the default frequencies up to the original context, longer sequences refused (rotary.py)
    "dynamic": ("factor", "original_max_position_embeddings"),
}
# keys a type may have besides those it needs (transformers' defaults apply when absent)
ROPE_SCALING_OPTIONS = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
                        "longrope": ("attention_factor",)}
# why each size must divide by the tensor-parallel size (said in the error)
HEADS_SPLIT = "each tensor-parallel rank holds whole heads"
FFN_SPLIT = "each tensor-parallel rank holds an equal slice of the MLP's hidden units"


@dataclass
class TransformerConfig:
    """Hyper-parameters of a transformer stack.

    ``layernorm_order="pre"`` is Megatron's reordered layer (seed 002, Figure 7b: norm before
    attention/MLP, residual around, a final norm) which trains stably at scale; ``"post"`` is the
    original BERT layer (residual, then norm). ``init_seed`` makes initialisation a function of
    the global layer index, so every parallel layout builds the same model.

    Llama-family options: ``num_query_groups`` key/value heads (grouped-query attention; None: one
    per query head), ``kv_channels`` the head size when it is not ``hidden_size / heads``,
    ``position_embedding_type="rope"`` rotary embeddings (``rotary_base``, ``rotary_percent`` of
    each head rotated, ``rope_scaling`` ``{"rope_type": "linear" | "llama3" | "yarn", ...}`` with Hugging
    Face's keys) instead of a learned position table, ``sliding_window`` (Mistral: a query sees itself and the
    ``sliding_window - 1`` keys before it; on the layers ``sliding_window_layers`` numbers, 1-based, or every layer;
    under context parallelism longer sequences are refused), ``add_qkv_bias`` (Qwen2: biases on the
    query/key/value projections only), ``qk_layernorm`` (Qwen3: ``normalization`` over each head's query and key
    channels, one weight of ``head_dim`` shared by the heads, before the rotation; with
    ``qk_layernorm_across_heads``, OLMo-2's RMSNorm over all heads' channels at once, one weight per channel of
    every head, its statistics summed over tensor-parallel ranks).
    Gemma 2/3: ``layernorm_order="sandwich"`` (norms before and after each sub-block; OLMo-2's
    ``"post_sublayer"`` has only those after), ``softmax_scale`` (their ``query_pre_attn_scalar ** -0.5``),
    ``attn_logit_softcapping`` and ``final_logit_softcapping`` (``c * tanh(x / c)`` on the attention scores and on
    the output logits); Gemma 3's windowed layers rotate by ``window_rotary_base`` without ``rope_scaling``.
    Gemma: ``activation="geglu"`` (gate and up projections, tanh-approximated GELU on the gate),
    ``layernorm_zero_centered_gamma`` (Megatron-Core's name: every norm scales by ``1 + weight``, computed in
    float32, weights stored centred on 0) and ``embedding_multiplier`` (``sqrt(hidden_size)``, in the
    activations' dtype as transformers applies it).

    ``document_attention``: the kernel of attention within packed documents (``document_ids``):
    ``"auto"`` FlexAttention on CUDA without attention dropout and boolean-mask SDPA otherwise,
    ``"flex"`` or ``"mask"`` to force one (see ``transformer/documents.py``).

    ``gradient_accumulation_fusion`` (Megatron-Core's name): the linears' weight gradients accumulated by their GEMM
    (``tensor_parallel/grad_accumulation.py``). ``"auto"`` turns it on where it measured faster and can work: in the
    layers ``MegatronStrategy`` compiles, when it captures no CUDA graph (``transformer/grad_accumulation_default.py``);
    a model used without the strategy keeps it off. ``True`` everywhere (refused in compiled layers inside a CUDA
    graph), ``False`` nowhere.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None          # default 4 * hidden_size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "gelu"                       # gelu | gelu_tanh | swiglu | geglu (gated gelu_tanh: Gemma)
    normalization: str = "LayerNorm"               # LayerNorm | RMSNorm
    layernorm_epsilon: float = 1e-5
    layernorm_order: str = "pre"                   # pre | post | sandwich (Gemma 2/3) | post_sublayer (OLMo-2)
    attn_mask_type: str = "causal"                 # causal | padding
    add_bias_linear: bool = True
    init_method_std: float = 0.02
    scale_output_layer_init: bool = True           # std / sqrt(2 * num_layers) for residual writers
    init_seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False                  # sequence-parallel gathers/reduce-scatters overlap the GEMMs
    gradient_accumulation_fusion: Union[bool, str] = "auto"   # linears' weight gradients accumulated by their
                                                   # GEMM (addmm_); "auto": in compiled layers outside CUDA graphs
    recompute_layers: bool = False                 # activation checkpointing per layer
    moe: Optional[Any] = None                      # a moe.MoEConfig: MLPs become mixture-of-experts layers
    moe_layer_freq: int = 1                        # every k-th layer (1-based: layers 1, 1+k, ...) is MoE
    num_query_groups: Optional[int] = None         # key/value heads (GQA); None: as many as attention heads
    kv_channels: Optional[int] = None              # head size; None: hidden_size // num_attention_heads
    position_embedding_type: str = "learned"       # learned | rope | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0                    # share of each head's channels that rotate
    rope_scaling: Optional[Dict[str, Any]] = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...}
    sliding_window: Optional[int] = None           # a query sees at most this many keys, itself included (Mistral)
    sliding_window_layers: Optional[Tuple[int, ...]] = None   # 1-based layers with the window; None: every layer
    window_rotary_base: Optional[float] = None     # windowed layers' rotary base, no rope_scaling (Gemma 3's local)
    softmax_scale: Optional[float] = None          # attention scores times this; None: 1 / sqrt(head_dim)
    attn_logit_softcapping: Optional[float] = None   # scores -> c * tanh(scores / c) before the softmax (Gemma 2)
    final_logit_softcapping: Optional[float] = None  # the output logits likewise, before the loss (Gemma 2)
    document_attention: str = "auto"               # packed rows' kernel: auto | flex | mask (documents.py)
    add_qkv_bias: Optional[bool] = None            # biases on the query/key/value projections (Qwen2); None: as
                                                   # add_bias_linear (the output projection follows add_bias_linear)
    qk_layernorm: bool = False                     # normalize each head's queries and keys before RoPE (Qwen3)
    qk_layernorm_across_heads: bool = False        # qk_layernorm over all heads' channels at once (OLMo-2)
    layernorm_zero_centered_gamma: bool = False    # norms scale by (1 + weight), weights start at 0 (Gemma)
    embedding_multiplier: float = 1.0              # word embeddings times this (Gemma: sqrt(hidden_size))

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}.")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size < 1:
            raise ValueError(f"TransformerConfig.ffn_hidden_size must be positive, got {self.ffn_hidden_size}.")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TransformerConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; each head needs an equal share "
                f"(or set kv_channels, the head size)."
            )
        self._check_attention_shape()
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"TransformerConfig.{name} must be in [0, 1), got {value}.")
        for name, allowed in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS),
                              ("layernorm_order", LAYERNORM_ORDERS), ("attn_mask_type", MASK_TYPES),
                              ("document_attention", DOCUMENT_ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"TransformerConfig.{name}={getattr(self, name)!r} is not one of {list(allowed)}.")
        if self.init_method_std <= 0:
            raise ValueError(f"TransformerConfig.init_method_std must be positive, got {self.init_method_std}.")
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError(f"TransformerConfig.moe.hidden_size={self.moe.hidden_size} must equal "
                             f"hidden_size={self.hidden_size}.")
        if self.moe_layer_freq < 1:
            raise ValueError(f"TransformerConfig.moe_layer_freq must be >= 1, got {self.moe_layer_freq}.")
        if self.document_attention == "flex" and self.attention_dropout > 0:
            raise ValueError(f"TransformerConfig.document_attention='flex' with attention_dropout="
                             f"{self.attention_dropout}: FlexAttention has no dropout; use document_attention='auto' "
                             f"or 'mask' (boolean-mask SDPA, with dropout), or attention_dropout=0.")
        if not isinstance(self.layernorm_zero_centered_gamma, bool):
            raise ValueError(f"TransformerConfig.layernorm_zero_centered_gamma must be True or False, got "
                             f"{self.layernorm_zero_centered_gamma!r}.")
        if isinstance(self.embedding_multiplier, bool) or not isinstance(self.embedding_multiplier, (int, float)) \
                or not self.embedding_multiplier > 0:
            raise ValueError(f"TransformerConfig.embedding_multiplier must be a positive number, got "
                             f"{self.embedding_multiplier!r}.")
        if not isinstance(self.qk_layernorm, bool):
            raise ValueError(f"TransformerConfig.qk_layernorm must be True or False, got {self.qk_layernorm!r}.")
        if self.gradient_accumulation_fusion not in (True, False, "auto") or \
                not isinstance(self.gradient_accumulation_fusion, (bool, str)):
            raise ValueError(f"TransformerConfig.gradient_accumulation_fusion must be True, False or 'auto' (fused "
                             f"where the strategy compiles the layers and captures no CUDA graph), got "
                             f"{self.gradient_accumulation_fusion!r}.")
        self._check_attention_variants()
        if self.add_qkv_bias not in (None, True, False):
            raise ValueError(f"TransformerConfig.add_qkv_bias must be None (as add_bias_linear), True or False, got "
                             f"{self.add_qkv_bias!r}.")
        if not self.params_dtype.is_floating_point:
            raise ValueError(f"TransformerConfig.params_dtype must be a floating dtype, got {self.params_dtype}.")

    def _check_attention_variants(self) -> None:
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"TransformerConfig.{name} must be a positive number or None, got {value!r}.")
        if not isinstance(self.qk_layernorm_across_heads, bool):
            raise ValueError(f"TransformerConfig.qk_layernorm_across_heads must be True or False, got "
                             f"{self.qk_layernorm_across_heads!r}.")
        if self.qk_layernorm_across_heads and (not self.qk_layernorm or self.normalization != "RMSNorm"):
            raise ValueError(f"TransformerConfig.qk_layernorm_across_heads=True needs qk_layernorm=True (it says how "
                             f"the query/key norms span the heads) and normalization='RMSNorm', got qk_layernorm="
                             f"{self.qk_layernorm}, normalization={self.normalization!r}.")
        if self.window_rotary_base is not None and (self.sliding_window is None or self.window_rotary_base <= 0):
            raise ValueError(f"TransformerConfig.window_rotary_base={self.window_rotary_base} needs a sliding_window "
                             f"(it is the windowed layers' rotary base) and must be positive.")
        layers = self.sliding_window_layers
        if layers is None:
            return
        if self.sliding_window is None:
            raise ValueError(f"TransformerConfig.sliding_window_layers={layers!r} needs sliding_window (the window "
                             f"those layers use).")
        if isinstance(layers, (str, bytes)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.num_layers for n in layers):
            raise ValueError(f"TransformerConfig.sliding_window_layers must list layer numbers from 1 to num_layers="
                             f"{self.num_layers} (1-based), got {layers!r}.")
        self.sliding_window_layers = tuple(sorted(set(layers)))

    def window_of(self, layer_number: int) -> Optional[int]:
        """The sliding window of layer ``layer_number`` (1-based), or None: full attention."""
        if self.sliding_window_layers is not None and layer_number not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer_number: int) -> bool:
        """Layers 1, 1 + k, 1 + 2k, ... (1-based, as ``TransformerLayer`` numbers them) are mixture-of-experts
        layers (``moe_layer_freq=k``)."""
        return self.moe is not None and (layer_number - 1) % self.moe_layer_freq == 0

    @property
    def qkv_bias(self) -> bool:
        """Whether the query/key/value projections have biases."""
        return self.add_bias_linear if self.add_qkv_bias is None else self.add_qkv_bias

    def _check_attention_shape(self) -> None:
        for name in ("num_query_groups", "kv_channels", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TransformerConfig.{name} must be a positive integer or None, got {value!r}.")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"TransformerConfig.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}: each key/value head serves an equal group of query heads.")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"TransformerConfig.position_embedding_type={self.position_embedding_type!r} is not one "
                             f"of {list(POSITION_EMBEDDINGS)}.")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"TransformerConfig.rotary_percent must be in (0, 1], got {self.rotary_percent}.")
        if self.rotary_base <= 0:
            raise ValueError(f"TransformerConfig.rotary_base must be positive, got {self.rotary_base}.")
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"TransformerConfig.rotary_percent={self.rotary_percent} of head size {self.head_dim} "
                             f"rotates {self.rotary_dim} channels; rotary embeddings need an even number >= 2.")
        if self.rope_scaling is not None:
            self.rope_scaling = check_rope_scaling(self.rope_scaling)

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def grouped_query_attention(self) -> bool:
        return self.query_groups < self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotate (the first ones; the rest pass through)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer has the dense MLP (not all of them are mixture-of-experts layers)."""
        return self.moe is None or (self.moe_layer_freq > 1 and self.num_layers > 1)

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise, by this config's field name, if a size does not split over ``tp_size`` ranks.

        Called where the config meets the tensor-parallel size (every ``TransformerBlock``, and
        the attention and MLP layers for direct use), so the error names ``num_attention_heads``
        or ``ffn_hidden_size`` rather than the internal linear layer sizes they become. The
        hidden size needs no check of its own: it is a multiple of ``num_attention_heads``.
        The MoE experts' sizes are checked by the MoE layer (against the expert tp size).
        """
        check_splits_over_tensor_parallel("num_attention_heads", self.num_attention_heads, tp_size, HEADS_SPLIT)
        check_query_groups(self, tp_size)
        if self.has_dense_mlp:
            assert self.ffn_hidden_size is not None   # __post_init__ filled it
            check_splits_over_tensor_parallel("ffn_hidden_size", self.ffn_hidden_size, tp_size, FFN_SPLIT)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def output_layer_init_std(self) -> float:
        """Std of layers writing into the residual stream (attention output, MLP fc2)."""
        if self.scale_output_layer_init:
            return self.init_method_std / (2.0 * self.num_layers) ** 0.5
        return self.init_method_std


def check_splits_over_tensor_parallel(name: str, value: int, tp_size: int, why: str) -> None:
    """``TransformerConfig.<name>=<value>`` must divide by ``tensor_model_parallel_size``, or an error
    that names both and both ways out (another ``name``, another tp size)."""
    if value % tp_size == 0:
        return
    lower = value - value % tp_size
    multiples = [v for v in (lower, lower + tp_size) if v > 0]
    divisors = [d for d in range(2, tp_size) if value % d == 0][-2:] or [1]
    raise ValueError(
        f"TransformerConfig.{name}={value} is not divisible by tensor_model_parallel_size={tp_size}: {why}. "
        f"Use a {name} that is a multiple of {tp_size} (e.g. {' or '.join(map(str, multiples))}), or a "
        f"tensor_model_parallel_size that divides {value} (e.g. {' or '.join(map(str, divisors))}).")


def check_query_groups(config: TransformerConfig, tp_size: int) -> None:
    """Grouped-query attention under tensor parallelism: the key/value heads are split over the tp ranks
    when ``num_query_groups`` divides by ``tp_size``, each held by ``tp_size / num_query_groups`` ranks
    when it divides ``tp_size``; any other pair raises an error naming both."""
    groups = config.num_query_groups
    if groups is None or groups % tp_size == 0:
        return
    if tp_size % groups:
        raise ValueError(
            f"TransformerConfig.num_query_groups={groups} and tensor_model_parallel_size={tp_size}: one must divide "
            f"the other (key/value heads are split over the tensor-parallel ranks, or each shared by "
            f"tensor_model_parallel_size / num_query_groups ranks). Use a tensor_model_parallel_size that divides "
            f"{groups} or is a multiple of it.")
    rows = 2 * groups * config.head_dim
    if rows % tp_size:
        raise ValueError(
            f"TransformerConfig.num_query_groups={groups} with head size {config.head_dim} gives {rows} key/value "
            f"rows, not divisible by tensor_model_parallel_size={tp_size} (each rank stores an equal slice of them).")


def check_rope_scaling(scaling: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``rope_scaling`` with its type under ``"rope_type"`` (Hugging Face's older ``"type"`` accepted),
    None for ``"default"``; a ``ValueError`` naming the field for an unknown type or a missing key."""
    if not isinstance(scaling, dict):
        raise ValueError(f"TransformerConfig.rope_scaling must be a dict such as {{'rope_type': 'linear', "
                         f"'factor': 2.0}} or None, got {scaling!r}.")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"TransformerConfig.rope_scaling['rope_type']={kind!r} is not supported; use one of "
                         f"{sorted(ROPE_SCALINGS)} (or rope_scaling=None).")
    missing = [key for key in ROPE_SCALINGS[kind] if key not in scaling]
    if missing:
        raise ValueError(f"TransformerConfig.rope_scaling of rope_type {kind!r} needs {list(ROPE_SCALINGS[kind])}; "
                         f"missing {missing}.")
    if scaling["factor"] <= 0:
        raise ValueError(f"TransformerConfig.rope_scaling['factor'] must be positive, got {scaling['factor']}.")
    out = {key: scaling[key] for key in ROPE_SCALINGS[kind]}
    out.update({key: scaling[key] for key in ROPE_SCALING_OPTIONS.get(kind, ()) if scaling.get(key) is not None})
    out["rope_type"] = kind
    return out


_MODEL_DEFAULTS: ContextVar[Dict[str, Any]] = ContextVar("lightning_megatron_model_defaults", default={})


@contextmanager
def model_defaults(**fields: Any) -> Iterator[None]:
    """Config fields that models built inside this block take unless their config sets them (the strategy
    wraps ``configure_model`` in it: users set ``sequence_parallel`` once, on ``MegatronStrategy``)."""
    unknown = set(fields) - {"sequence_parallel", "tp_comm_overlap"}
    if unknown:
        raise ValueError(f"model_defaults takes sequence_parallel and tp_comm_overlap only, not {sorted(unknown)}.")
    token = _MODEL_DEFAULTS.set({**_MODEL_DEFAULTS.get(), **fields})
    try:
        yield
    finally:
        _MODEL_DEFAULTS.reset(token)


def with_strategy_defaults(config: TransformerConfig) -> TransformerConfig:
    """``config`` with the strategy's ``sequence_parallel=True`` and ``tp_comm_overlap=True`` applied, if the model
    is built under :func:`model_defaults` that asks for them."""
    asked: Dict[str, Any] = {name: True for name, value in _MODEL_DEFAULTS.get().items()
                             if value and not getattr(config, name)}
    return dataclasses.replace(config, **asked) if asked else config
