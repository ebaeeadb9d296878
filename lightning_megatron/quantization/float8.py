"""FP8 training of the linear layers through torchao's float8 training (no Transformer Engine).

Call :func:`enable_fp8` on the model once it is built, in ``configure_model``::

    def configure_model(self):
        if not hasattr(self, "model"):
            self.model = GPTModel(config, vocab_size, max_sequence_length)
            enable_fp8(self.model, "tensorwise")          # or "rowwise", or a Float8Config

Every ``ColumnParallelLinear`` / ``RowParallelLinear`` then runs its local matmul through torchao's
float8 autograd matmul (``torchao.float8.float8_linear.matmul_with_hp_or_float8_args``, the function
``torchao``'s ``Float8Linear`` calls) and keeps its tensor-parallel communication around it, in high
precision: column-parallel = copy / sequence-parallel all-gather of the input, float8 matmul, output
shard; row-parallel = float8 matmul, all-reduce / reduce-scatter. Plain ``nn.Linear`` layers are
swapped to torchao's ``Float8Linear`` by ``torchao.float8.convert_to_float8_training``. Parameters,
their names and checkpoints are unchanged: a model trained in float8 loads in bfloat16 and back.

Recipes: torchao's ``Float8LinearConfig.from_recipe_name``: ``"tensorwise"`` (one dynamic scale per
tensor) and ``"rowwise"`` (one per row along the contracted dimension, power-of-2 scales). Scales are
dynamic (computed from the tensor on every call, on the device): no host synchronization, so the
layers can be captured in CUDA graphs. ``Float8Config(compile=True)`` (the default) compiles each
cast-and-matmul with ``torch.compile`` (torchao's casts are separate, memory-bound kernels in eager
mode; compiled they fuse, which is where the speed-up comes from). ``Float8Config(compile_layers=True)``
compiles each whole transformer layer instead (``TransformerLayer.compile()``, in place), so the casts
also fuse with the norms, activations and residual adds around the matmuls (torchao's documented way
to its speed-ups: compile the model); tensor and context parallel size 1 only.

What each rank's scale is computed over (tensor parallelism, with or without sequence parallelism).
A scale is computed from the tensor the rank multiplies; no scale is reduced over the tp group, and
none needs to be: float8 values never cross ranks (inputs are gathered and outputs reduced in high
precision), so a scale has to be right only for the local matmul it dequantizes.

=================  ======================================  ========================================
tensor             column-parallel                         row-parallel
=================  ======================================  ========================================
input              the whole input (replicated, or the     this rank's slice of the features
                   sequence-parallel all-gather): every    (``in / tp``)
                   rank computes the TP=1 scale
weight             this rank's shard (``out / tp`` rows)   this rank's shard (``in / tp`` columns)
output gradient    this rank's slice (``out / tp``)        the whole gradient (replicated; with
                                                           sequence parallelism all-gathered by
                                                           the reduce-scatter's backward)
=================  ======================================  ========================================

Tensorwise: one scale over each of those tensors. Rowwise: one scale per row over the contracted
dimension: for column-parallel it is whole on every rank (the TP=1 scales exactly); for row-parallel
it is this rank's ``in / tp`` slice. A shard's scale is at least as fine as the TP=1 one, so TP=N is
not bit-identical to TP=1 in float8 but is exactly what ``Float8Linear`` computes on that rank's shard
(``tests/unit/quantization/test_fp8.py`` checks it at TP=2). An amax reduction over ranks is needed only to communicate
float8 tensors (torchao's ``enable_fsdp_float8_all_gather``, float8 all-gathers): both are off.

Grouped MoE experts (``GroupedMLP``) with ``Float8Config(grouped_experts=True)`` (off by default: slower than
bf16 where measured, see below) run both projections through torchao's float8 grouped GEMM
(``torchao.prototype.moe_training``'s ``_to_fp8_rowwise_then_scaled_grouped_mm``: row-wise power-of-2 scales
whatever the recipe of the linear layers, the only recipe torchao ships for grouped GEMMs). It needs every expert's row count to be a
multiple of 16: the rows are laid out in 16-aligned groups on the device (``moe.aligned_groups``; zero
rows between groups, no host synchronization) and put back after. Each rank's scales cover its own
experts' rows and weights (expert and expert-tensor parallelism communicate in high precision).
Measured on an H100 (torch 2.11, torchao 0.18): the float8 grouped GEMMs take 0.65x the bf16 ones' time,
but torchao's casts (weights re-cast every forward and backward) and the aligned layout cost more than
that saves: 0.67x the bf16 grouped GEMM's speed at 64 experts, hidden 4096, and 0.69x the tokens/s of an
MoE GPT with its experts in bf16 (``benchmarks/RESULTS.md``). Hence off by default.

Not converted: the vocabulary-parallel output layer / tied embedding (kept in high precision, as is
usual; ``Float8Config(output_layer=True)`` runs its GEMMs in float8 too, ``quantization/float8_output.py``), layers whose local weight is not a multiple of 16 in both dimensions (float8 GEMMs need it;
skipped with one warning naming them), grouped experts without ``grouped_experts=True`` or with
``emulate=True`` (torchao's grouped GEMM has no emulation; a warning names them). The number of tokens of a
layer's input (batch x sequence, per tp rank before any sequence-parallel gather) must be a multiple of 16 for
the backward; otherwise the layer raises a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch import nn

from ..moe.experts import GroupedMLP
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .float8_output import ALIGNMENT, Float8OutputLayer
from .float8_weights import (Float8WeightCast, cached_float8_linear, cached_forward, cached_input_grad,
                             cached_weight_grad, cast_output_grad, compiled_for_shape, compiled_piece)

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)           # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
MIN_TORCHAO = (0, 18)
INSTALL = "pip install 'lightning-megatron[fp8]'"
FilterFn = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class Float8Config:
    """How :func:`enable_fp8` converts a model.

    Args:
        recipe: ``"tensorwise"`` or ``"rowwise"``: torchao's ``Float8LinearConfig.from_recipe_name``.
        compile: ``torch.compile`` each layer's cast-and-matmul (static shapes; one compiled function
            per weight shape, shared by the layers of that shape; the first step compiles them).
            Without it torchao's casts run as separate eager kernels and float8 is usually slower
            than bfloat16.
        emulate: torchao's emulation (float8 values, high-precision matmul): runs on the CPU and on
            any GPU, for tests; no speed-up.
        auto_filter: leave in high precision the layers that torchao's measurements (H100) say are
            faster there (``torchao.float8._auto_filter_for_recipe``, applied to each rank's local
            weight shape).
        module_filter_fn: ``fn(module, fully_qualified_name) -> bool``: only layers it returns True
            for are converted (torchao's ``module_filter_fn`` convention).
        compile_layers: ``torch.compile`` every ``TransformerLayer`` that holds a converted layer, whole
            (``module.compile(dynamic=False)``, in place: parameter names and checkpoints unchanged), so
            the float8 casts fuse with the layer norms, the activation and the residual adds next to the
            matmuls (the per-matmul compilation of ``compile`` cannot fuse across a layer boundary).
            Needs ``compile=True``, and tensor- and context-parallel size 1 (``enable_fp8`` raises a
            ``ValueError`` otherwise: the collectives around the matmuls are not traced by
            ``torch.compile``). The first step compiles the layer (once, for all the layers of one
            shape). A per-layer CUDA graph (``cuda_graph``) calls the layer's sub-blocks directly and
            so runs them uncompiled. Default False.
        round_scales_to_power_of_2: round every float8 scale down to a power of 2 (torchao's
            ``Float8LinearConfig.round_scales_to_power_of_2``: the scaling is exact in floating point);
            ``None`` (default): the recipe's own setting (off for tensorwise, on for rowwise).
        grouped_experts: run the grouped MoE experts' GEMMs in float8 too (torchao's row-wise float8
            grouped GEMM, a torchao prototype; needs a GPU of compute capability 9.0+). Default False:
            measured slower than bf16 on an H100 (torch 2.11, torchao 0.18; see the module docstring).
        output_layer: run a ``GPTModel``'s output projection (the vocabulary GEMMs inside its fused loss, and
            the unfused logits) in float8 too (``quantization/float8_output.py``; tensorwise only; the model's
            ``cross_entropy_chunk_size`` must be None): the forward and the weight gradient in float8, the
            gradient of the hidden states in bf16 (rounded to float8 there, the loss left its early plateau 30-100+
            steps after bf16's in every run). Default False, as in Megatron-Core and torchtitan; opt in where the
            loss curve says so: on an H200 it made the Llama-3-8B layer shape's step 1.32x our compiled bf16
            (1.24x with the linears alone), and GPT-1.3B's 200-step curve (``bench_fp8.py``, one run) left the
            plateau with bf16's and ended within 0.3% of it (``benchmarks/RESULTS.md``, sixteenth session).
        cache_weights: cast each parallel linear's weight to float8 once per schedule (every micro-batch of a
            training step, or of an evaluation batch, run by the strategy's step engine; the cast is made at the
            layer's first forward, after its parameters' overlapped gather) instead of in every forward and
            backward (``quantization/float8_weights.py``): the same numbers as torchao's casts, bit for
            bit, for two bytes of memory per weight element. ``None`` (default): on for ``"tensorwise"``; the
            rowwise recipe recasts every call (``True`` with it raises).
    """

    recipe: str = "tensorwise"
    compile: bool = True
    emulate: bool = False
    auto_filter: bool = False
    module_filter_fn: Optional[FilterFn] = None
    compile_layers: bool = False
    round_scales_to_power_of_2: Optional[bool] = None
    grouped_experts: bool = False
    output_layer: bool = False
    cache_weights: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r} is not one of {list(RECIPES)} (torchao's float8 "
                             f"training recipes); use fp8=None to train without float8.")
        for name in ("compile", "emulate", "auto_filter", "compile_layers", "grouped_experts", "output_layer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Float8Config.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.round_scales_to_power_of_2 is not None and not isinstance(self.round_scales_to_power_of_2, bool):
            raise ValueError(f"Float8Config.round_scales_to_power_of_2 must be True, False or None (the recipe's "
                             f"default), got {self.round_scales_to_power_of_2!r}.")
        if self.cache_weights is not None and not isinstance(self.cache_weights, bool):
            raise ValueError(f"Float8Config.cache_weights must be True, False or None (on for the tensorwise recipe), "
                             f"got {self.cache_weights!r}.")
        if self.cache_weights and self.recipe != "tensorwise":
            raise ValueError(f"Float8Config(cache_weights=True) keeps tensorwise float8 weights for a whole step, got "
                             f"recipe={self.recipe!r} (its casts are torchao's, every call): use recipe='tensorwise', "
                             f"or cache_weights=None.")
        if self.output_layer and self.recipe != "tensorwise":
            raise ValueError(f"Float8Config(output_layer=True) runs the output layer with tensorwise scales only, "
                             f"got recipe={self.recipe!r}: use recipe='tensorwise', or output_layer=False.")
        if self.compile_layers and not self.compile:
            raise ValueError("Float8Config(compile_layers=True) compiles the transformer layers with their float8 "
                             "matmuls inside, and compile=False asks for no compilation: set compile=True, or "
                             "compile_layers=False.")
        if self.module_filter_fn is not None and not callable(self.module_filter_fn):
            raise ValueError(f"Float8Config.module_filter_fn must be callable(module, name) -> bool, "
                             f"got {self.module_filter_fn!r}.")

    @property
    def weights_cached(self) -> bool:
        """Whether the parallel linears' weights are cast once per schedule (``cache_weights``; None: tensorwise)."""
        return self.recipe == "tensorwise" if self.cache_weights is None else self.cache_weights

    def torchao_config(self):
        """torchao's ``Float8LinearConfig`` of this recipe (``emulate`` applied). Needs torchao."""
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        if self.emulate:
            config = dataclasses.replace(config, emulate=True)
        if self.round_scales_to_power_of_2 is not None:
            config = dataclasses.replace(config, round_scales_to_power_of_2=self.round_scales_to_power_of_2)
        # the layers communicate in high precision and need no padding: these must stay off
        assert not config.enable_fsdp_float8_all_gather and not config.pad_inner_dim, config
        return config


def fp8_config(fp8: Union[None, str, Float8Config]) -> Optional[Float8Config]:
    """The ``fp8=`` option as a :class:`Float8Config`: ``None`` (off), a recipe name, or a config."""
    if fp8 is None or isinstance(fp8, Float8Config):
        return fp8
    if isinstance(fp8, str):
        return Float8Config(fp8)
    raise ValueError(f"fp8={fp8!r} must be None, one of {list(RECIPES)}, or a lightning_megatron.quantization.float8.Float8Config.")


def _version_tuple(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def check_fp8_supported(config: Float8Config) -> None:
    """Raise one error naming the option and the fix if float8 training cannot run here: torchao missing
    or too old (``ImportError``), no CUDA GPU with compute capability >= 8.9 (``RuntimeError``; not
    checked with ``emulate=True``)."""
    option = f"fp8={config.recipe!r}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{option} trains through torchao's float8 training, and torchao is not installed "
                          f"({err}). Install it with: {INSTALL} (torchao>=0.18), or set fp8=None.") from err
    try:
        version = metadata.version("torchao")
    except metadata.PackageNotFoundError:   # a source checkout: trust it
        version = None
    if version is not None and _version_tuple(version) < MIN_TORCHAO:
        raise ImportError(f"{option} needs torchao>=0.18, found torchao {version}: pip install -U "
                          f"'lightning-megatron[fp8]'.")
    if config.emulate:
        return
    if not torch.cuda.is_available():
        found = "no CUDA GPU is available here"
    else:
        capability = torch.cuda.get_device_capability()
        if capability >= MIN_CAPABILITY:
            return
        found = (f"this GPU ({torch.cuda.get_device_name()}) has compute capability "
                 f"{capability[0]}.{capability[1]}")
    raise RuntimeError(f"{option} needs a CUDA GPU with compute capability >= 8.9 (float8 tensor cores: Ada, "
                       f"Hopper or newer), and {found}. Train with fp8=None here (float8 needs {INSTALL} "
                       f"and such a GPU).")


def _patch_inductor_for_float8(config) -> None:
    """torchao's inductor workaround for compiled float8 casts (triton-lang/triton#11111), applied by its
    public entry point ``convert_to_float8_training`` before anything is compiled: nothing here to swap."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(nn.Module(), config=config)


#: ``(recipe, emulate, round_scales_to_power_of_2) -> eager float8 linear``, filled by ``enable_fp8``: what a
#: layer calls while ``torch.compile`` traces it into a larger graph (a plain dict lookup, nothing to trace)
_EAGER_FLOAT8_LINEAR: dict = {}


@functools.lru_cache(maxsize=None)
def _float8_linear(recipe: str, emulate: bool, compiled: bool, shape: Optional[tuple] = None,
                   pow2: Optional[bool] = None) -> Callable:
    """``(x, weight, bias) -> x @ weight.T + bias`` through torchao's float8 autograd matmul, as
    ``Float8Linear.forward`` calls it. Eager: one function per recipe. Compiled: one per recipe and
    ``shape`` (the weight's, and whether there is a bias), each with its own code object and so its own
    ``torch.compile`` cache (``float8_weights.compiled_for_shape``)."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = Float8Config(recipe, emulate=emulate, round_scales_to_power_of_2=pow2).torchao_config()
    # torchao's own per-GEMM settings (fast accumulation in the forward only, ...), from a meta-device layer
    mm_config = Float8Linear(ALIGNMENT, ALIGNMENT, bias=False, config=config, device="meta").linear_mm_config

    def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
        return out if bias is None else out + bias.to(out.dtype)

    if not compiled:
        return float8_linear
    _patch_inductor_for_float8(config)
    return compiled_for_shape(float8_linear, f"float8_linear_{recipe}_" + "_".join(map(str, shape or ())))


def _cached_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], data: torch.Tensor,
                          data_t: torch.Tensor, scale: torch.Tensor, pow2: bool, emulate: bool) -> torch.Tensor:
    """``x @ weight.T + bias`` from the weight's float8 casts (``float8_weights.py``)."""
    out = cached_float8_linear(x, weight, data, data_t, scale, pow2, emulate)
    return out if bias is None else out + bias.to(out.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_cached_weight_linear(shape: tuple) -> Callable:
    """:func:`_cached_weight_linear` compiled for one ``shape`` (as :func:`_float8_linear`)."""
    def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], data: torch.Tensor,
                      data_t: torch.Tensor, scale: torch.Tensor, pow2: bool, emulate: bool) -> torch.Tensor:
        return _cached_weight_linear(x, weight, bias, data, data_t, scale, pow2, emulate)

    return compiled_for_shape(float8_linear, "float8_linear_cached_" + "_".join(map(str, shape)))


class Float8Matmul:
    """One layer's local ``x @ weight.T + bias`` in float8 (what :func:`enable_fp8` puts in a parallel
    linear's ``float8`` attribute). Holds its config, the layer's name and, where weights are cast once per
    schedule (``Float8Config.cache_weights``), the layer's :class:`~.float8_weights.Float8WeightCast`."""

    def __init__(self, config: Float8Config, name: str, weight_cast: Optional[Float8WeightCast] = None) -> None:
        self.config, self.name, self.weight_cast = config, name, weight_cast

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 own_weight: bool = False) -> torch.Tensor:
        """``own_weight``: ``weight`` is the layer's parameter (the one its ``weight_cast`` casts), not a
        tensor made from it."""
        if torch.is_autocast_enabled(x.device.type):   # as Float8Linear: the output has the autocast dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        self._check(x, weight, x.numel() // x.shape[-1] if x.dim() else 0)
        config = self.config
        shape = (*weight.shape, bias is not None) if config.compile else None
        cast = self.weight_cast
        if own_weight and cast is not None and cast.ready():   # cast once for this schedule (float8_weights.py)
            assert cast.data is not None and cast.data_t is not None and cast.scale is not None   # ready: cast
            # traced into a compiled layer, or no compile: the function itself; else compiled for this shape
            traced = torch.compiler.is_compiling()
            fn = _cached_weight_linear if traced or shape is None else _compiled_cached_weight_linear(shape)
            return fn(x, weight, bias, cast.data, cast.data_t, cast.scale, cast.pow2, config.emulate)
        if torch.compiler.is_compiling():   # traced into a larger compiled graph (compile_layers): the eager matmul
            key = (config.recipe, config.emulate, config.round_scales_to_power_of_2)
            fn = _EAGER_FLOAT8_LINEAR.get(key) or _float8_linear(*key[:2], False, None, key[2])
            return fn(x, weight, bias)
        return _float8_linear(config.recipe, config.emulate, config.compile, shape,
                              config.round_scales_to_power_of_2)(x, weight, bias)

    def _check(self, x: torch.Tensor, weight: torch.Tensor, tokens: int) -> None:
        """One clear error for a GEMM float8 cannot run: on the CPU (unless emulated) or misaligned (``tokens``: the
        rows of the input it multiplies)."""
        if x.device.type != "cuda" and not self.config.emulate:
            raise RuntimeError(f"{self.name}: fp8={self.config.recipe!r} runs float8 GEMMs on a CUDA GPU, but its "
                               f"input is on {x.device}. Move the model to the GPU or train with fp8=None.")
        needs_backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if weight.shape[0] % ALIGNMENT or weight.shape[1] % ALIGNMENT or (needs_backward and tokens % ALIGNMENT):
            raise ValueError(
                f"{self.name}: fp8={self.config.recipe!r} needs every dimension of its float8 GEMMs to be a multiple "
                f"of {ALIGNMENT}: weight {tuple(weight.shape)}, {tokens} tokens (batch x sequence of this input). "
                f"Use a batch size / sequence length whose product is a multiple of {ALIGNMENT}, or leave this "
                f"layer out (Float8Config(module_filter_fn=...)).")

    # -- the GEMMs one at a time (tensor_parallel.column_backward.SplitGemms), where the weight is cast for the step:
    # a column-parallel linear then starts its input gradient's collective before the weight gradient's GEMM
    def split_gemms(self, x: torch.Tensor, weight: torch.Tensor, tokens: int) -> Optional["Float8Matmul"]:
        """This matmul as :class:`~lightning_megatron.tensor_parallel.column_backward.SplitGemms` for the layer's own
        ``weight`` when its cast holds it for this schedule and the schedule runs in CUDA graphs (``tokens``: the
        rows of the gathered input), else None (the layer calls it whole). Only in graphs: called eagerly, the
        three pieces' host work cost more than the overlap gains (4x H200, 8B layer shape, TP4 + SP: 407 against
        332 ms a step; about even at TP2), while a graph replays them without it."""
        cast = self.weight_cast
        if cast is None or not cast.ready() or not cast.graphed:
            return None
        self._check(x, weight, tokens)
        return self

    def _piece(self, fn: Callable, *operands: torch.Tensor) -> Callable:
        """``fn`` compiled for these operands' shapes (``Float8Config.compile``, GPUs), else itself."""
        if self.config.compile and operands[0].is_cuda:
            return compiled_piece(fn, tuple(tuple(t.shape) for t in operands))
        return fn

    def forward_gemm(self, total: torch.Tensor, weight: torch.Tensor) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        cast = self.weight_cast
        assert cast is not None and cast.ready() and cast.data is not None and cast.data_t is not None
        assert cast.scale is not None
        out = self._piece(cached_forward, total, cast.data)(total, cast.data, cast.scale, cast.pow2,
                                                            self.config.emulate)
        return out, (cast.data, cast.data_t, cast.scale)

    def input_grad_gemm(self, grad: torch.Tensor, weight: torch.Tensor,
                        saved: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, Any]:
        data, data_t, scale = saved
        assert self.weight_cast is not None
        grad_x, g8, g_scale = self._piece(cached_input_grad, grad, data)(grad, data, data_t, scale,
                                                                          self.weight_cast.pow2, self.config.emulate)
        return grad_x, (g8, g_scale)

    def grad_operand(self, grad: torch.Tensor, saved: Tuple[torch.Tensor, ...]) -> Any:
        assert self.weight_cast is not None
        return self._piece(cast_output_grad, grad)(grad, self.weight_cast.pow2)

    def weight_grad_gemm(self, operand: Any, total: torch.Tensor, weight: torch.Tensor,
                         saved: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        g8, g_scale = operand
        assert self.weight_cast is not None
        grad_w = self._piece(cached_weight_grad, g8, total)(g8, g_scale, total, self.weight_cast.pow2,
                                                            self.config.emulate, total.dtype)
        return grad_w.to(weight.dtype)

    def __repr__(self) -> str:
        return self.config.recipe + (" (emulated)" if self.config.emulate else "")


class Float8GroupedMatmul:
    """A ``GroupedMLP``'s grouped GEMM ``a [R, K] x b_t [E, K, N]`` in float8 (what :func:`enable_fp8` puts
    in its ``float8`` attribute): torchao's row-wise float8 grouped matmul, forward and backward. Groups
    must be ``alignment``-aligned (``GroupedMLP.aligned_forward`` lays the rows out so)."""

    alignment = ALIGNMENT

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if a.device.type != "cuda":
            raise RuntimeError(f"{self.name}: float8 grouped experts run on a CUDA GPU, but the input is on "
                               f"{a.device}. Move the model to the GPU, or Float8Config(grouped_experts=False).")
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        dtype = a.dtype
        if torch.is_autocast_enabled("cuda"):   # the output has the autocast dtype, as a float8 linear's
            dtype = torch.get_autocast_dtype("cuda")
        out = _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offsets, out_dtype=torch.bfloat16,
                                                     pad_token_groups_for_grouped_mm=False)
        return out if dtype == torch.bfloat16 else out.to(dtype)

    def __repr__(self) -> str:
        return "rowwise grouped"


def _check_grouped_float8_supported() -> None:
    """torchao's float8 grouped GEMM: importable (Triton) and a GPU with grouped GEMMs (compute capability 9.0+)."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm  # noqa: F401
    except ImportError as err:
        raise ImportError(f"Float8Config(grouped_experts=True) needs torchao's float8 grouped GEMM "
                          f"(torchao.prototype.moe_training, with Triton), which did not import ({err}); "
                          f"use Float8Config(grouped_experts=False) to keep the experts in high precision.") from err
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        raise RuntimeError(f"Float8Config(grouped_experts=True): float8 grouped GEMMs need a GPU of compute "
                           f"capability >= 9.0 (Hopper), this one is {major}.{minor}; use "
                           f"Float8Config(grouped_experts=False) to keep the experts in high precision.")


def _auto_keeps(config: Float8Config, name: str, out_features: int, in_features: int) -> bool:
    """torchao's size heuristic for ``config.recipe``, on a meta ``nn.Linear`` of this rank's shape."""
    from torchao.float8 import _auto_filter_for_recipe

    probe = nn.Linear(in_features, out_features, bias=False, device="meta")
    return _auto_filter_for_recipe(config.recipe, filter_fqns=[])(probe, name)


def _check_compile_layers_supported() -> None:
    from ..parallel import get_parallel_state, has_parallel_state

    if not has_parallel_state():
        return
    state = get_parallel_state()
    if state.tp_size > 1 or state.cp_size > 1:
        raise ValueError(f"Float8Config(compile_layers=True) compiles whole transformer layers and supports "
                         f"tensor- and context-parallel size 1 only (the collectives around the parallel matmuls "
                         f"are not traced), here tp={state.tp_size}, cp={state.cp_size}: use "
                         f"compile_layers=False (each float8 matmul compiled on its own).")


def _compile_layers(model: nn.Module, config: Float8Config, converted: set) -> None:
    """``compile_layers``: compile, in place, every ``TransformerLayer`` that holds a converted layer."""
    from ..transformer.layer import TransformerLayer

    _patch_inductor_for_float8(config.torchao_config())
    compiled = 0
    for name, module in model.named_modules():
        if not isinstance(module, TransformerLayer):
            continue
        prefix = f"{name}." if name else ""
        if any(c.startswith(prefix) for c in converted):
            module.compile(dynamic=False)
            compiled += 1
    if not compiled:
        warnings.warn(f"Float8Config(compile_layers=True): {type(model).__name__} holds no TransformerLayer with a "
                      f"float8 layer, nothing was compiled whole (each float8 matmul is still compiled on its own).",
                      UserWarning, stacklevel=3)


def _convert_output_layers(model: nn.Module, config: Float8Config) -> List[str]:
    """``output_layer``: the last-stage language models of ``model`` (modules with an ``output_float8`` slot,
    ``GPTModel``) get a :class:`~.float8_output.Float8OutputLayer`; returns their names (``<model>.output_layer``).
    Earlier pipeline stages hold none; a model holding no language model at all is refused by name."""
    from ..parallel import get_parallel_state, has_parallel_state

    models = [(name, m) for name, m in model.named_modules() if hasattr(m, "output_float8")]
    if not models:
        raise ValueError(f"Float8Config(output_layer=True) converts a GPTModel's output layer, and "
                         f"{type(model).__name__} holds no GPTModel: set output_layer=False.")
    converted = []
    for name, lm in models:
        if not lm.post_process:   # not the last pipeline stage: no output layer here
            continue
        label = f"{name}.output_layer" if name else "output_layer"
        if getattr(lm, "cross_entropy_chunk_size", None) is not None:
            raise ValueError(f"Float8Config(output_layer=True) runs {label} in float8 in the whole-logits fused loss, "
                             f"and the model's cross_entropy_chunk_size={lm.cross_entropy_chunk_size} asks for "
                             f"chunks: set cross_entropy_chunk_size=None, or output_layer=False.")
        weight = lm.output_weight if lm.output_weight is not None else lm.embedding.word_embeddings.weight
        rows, hidden = weight.shape
        tp = get_parallel_state().tp_size if has_parallel_state() else 1
        # every tp rank's rows inside the vocabulary, so that each rank decides alike
        real = [max(0, min(rows, lm.vocab_size - r * rows)) for r in range(tp)]
        if hidden % ALIGNMENT or any(n % ALIGNMENT for n in [rows, *real]):
            raise ValueError(f"Float8Config(output_layer=True): {label} multiplies {hidden} hidden features by "
                             f"{real} vocabulary rows per tensor-parallel rank (of {rows}), and float8 GEMMs need "
                             f"multiples of {ALIGNMENT}: pad the vocabulary to a multiple of {ALIGNMENT * tp}, or "
                             f"set output_layer=False.")
        lm.output_float8 = Float8OutputLayer(label, Float8Matmul(config, label), config.compile,
                                             bool(config.round_scales_to_power_of_2), config.emulate)
        converted.append(label)
    return converted


def enable_fp8(model: nn.Module, fp8: Union[None, str, Float8Config] = "tensorwise") -> List[str]:
    """Train ``model``'s linear layers in float8 through torchao; returns the names of the converted layers.

    ``fp8``: ``"tensorwise"``, ``"rowwise"``, a :class:`Float8Config`, or ``None`` (nothing happens).
    Converts, in place: every ``ColumnParallelLinear`` / ``RowParallelLinear`` (their local matmul; see
    the module docstring for what each rank's scales are computed over) and every ``nn.Linear`` (swapped
    to torchao's ``Float8Linear``). Call it once the model is built (``configure_model``), before the
    optimizer exists or after: parameters stay the same objects.

    With ``Float8Config(compile_layers=True)`` every ``TransformerLayer`` holding a converted layer is
    compiled whole, in place (``ValueError`` at tensor- or context-parallel size > 1).

    Raises ``ImportError`` without torchao and ``RuntimeError`` without a CUDA GPU of compute capability
    >= 8.9 (9.0 for grouped experts), each naming the fix. Layers whose local weight is not a multiple of 16
    in both dimensions stay in high precision (one warning names them); grouped MoE experts run in float8
    with ``Float8Config(grouped_experts=True)`` only (otherwise, or with ``emulate=True``, a warning names them).
    """
    config = fp8_config(fp8)
    if config is None:
        return []
    if isinstance(model, nn.Linear):
        raise ValueError("enable_fp8 converts the layers inside a model in place: pass the module that holds "
                         "this nn.Linear (or use torchao.float8.convert_to_float8_training on it).")
    overlapped = [name for name, m in model.named_modules() if getattr(m, "comm_overlap", False)
                  and getattr(m, "sequence_parallel", False)]
    if overlapped:   # before anything runs: the overlapped linears multiply in high precision only
        raise ValueError(f"fp8 does not combine with tp_comm_overlap=True yet ({len(overlapped)} overlapped linears, "
                         f"e.g. {overlapped[0]}): turn one of them off.")
    check_fp8_supported(config)
    if config.compile_layers:
        _check_compile_layers_supported()
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    key = (config.recipe, config.emulate, config.round_scales_to_power_of_2)
    _EAGER_FLOAT8_LINEAR[key] = _float8_linear(*key[:2], False, None, key[2])

    converted: List[str] = []
    misaligned: List[str] = []
    experts: List[str] = []           # grouped experts left in high precision (the default, or emulation)
    grouped_checked: List[bool] = []

    def keep(module: nn.Module, name: str, out_features: int, in_features: int) -> bool:
        if config.module_filter_fn is not None and not config.module_filter_fn(module, name):
            return False
        if out_features % ALIGNMENT or in_features % ALIGNMENT:
            misaligned.append(f"{name or type(module).__name__} ({type(module).__name__}, local weight "
                              f"{out_features}x{in_features})")
            return False
        return not config.auto_filter or _auto_keeps(config, name, out_features, in_features)

    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if keep(module, name, *module.weight.shape):
                cast = (Float8WeightCast(module, bool(config.round_scales_to_power_of_2), config.compile)
                        if config.weights_cached else None)
                module.float8 = Float8Matmul(config, name or type(module).__name__, cast)
                converted.append(name)
        elif isinstance(module, GroupedMLP):
            label = name or type(module).__name__
            local_ffn = module.weight2.shape[-1]
            if not config.grouped_experts or config.emulate:
                experts.append(label)
            elif config.module_filter_fn is not None and not config.module_filter_fn(module, name):
                continue
            elif module.hidden_size % ALIGNMENT or local_ffn % ALIGNMENT:
                misaligned.append(f"{label} (GroupedMLP, hidden {module.hidden_size}, ffn per expert on this rank "
                                  f"{local_ffn})")
            else:
                if not grouped_checked:
                    _check_grouped_float8_supported()
                    grouped_checked.append(True)
                module.float8 = Float8GroupedMatmul(label)
                converted.append(name)

    swapped: List[str] = []

    def keep_linear(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
            return False
        if keep(module, name, *module.weight.shape):
            swapped.append(name)
            return True
        return False

    if config.output_layer:
        converted += _convert_output_layers(model, config)
    convert_to_float8_training(model, config=config.torchao_config(), module_filter_fn=keep_linear)
    if config.compile:
        names = set(swapped)
        for name, module in model.named_modules():
            if name in names and isinstance(module, Float8Linear):
                module.compile()
    converted += swapped
    if config.compile_layers and converted:
        _compile_layers(model, config, set(converted))

    if misaligned:
        warnings.warn(f"fp8={config.recipe!r}: these layers stay in high precision, their local weight is not a "
                      f"multiple of {ALIGNMENT} in both dimensions (float8 GEMMs need it): {', '.join(misaligned)}.",
                      UserWarning, stacklevel=2)
    if experts:
        why = ("with emulate=True (torchao's float8 grouped GEMM has no emulation)" if config.grouped_experts else
               "(Float8Config(grouped_experts=True) runs them in float8: slower than bf16 on an H100 with torchao "
               "0.18, measured)")
        warnings.warn(f"fp8={config.recipe!r}: the grouped MoE experts stay in high precision {why}: "
                      f"{', '.join(experts)}.", UserWarning, stacklevel=2)
    if not converted:
        warnings.warn(f"fp8={config.recipe!r}: enable_fp8 found no linear layer to convert in "
                      f"{type(model).__name__}.", UserWarning, stacklevel=2)
    return converted


__all__ = ["Float8Config", "Float8GroupedMatmul", "Float8Matmul", "RECIPES", "check_fp8_supported", "enable_fp8",
           "fp8_config"]
