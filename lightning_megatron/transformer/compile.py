"""Compiled transformer layers: each layer's bodies ``torch.compile``d, as torchtitan compiles each block.

Inductor fuses what eager PyTorch runs as separate memory-bound kernels: the norms, the rotary rotation
(its angles included), SwiGLU/GeLU, dropout and the residual adds. The matmuls stay cuBLAS and
attention stays SDPA's kernels, so the gain is the elementwise traffic.

What is compiled: a layer's eager bodies (``_forward``, ``_attention_block``, ``_mlp_block``), bound on the
instance, not the module's ``__call__``: the module tree and the state dict are unchanged (no ``_orig_mod``:
a checkpoint saved compiled resumes eager and the reverse), and per-layer CUDA graphs capture the compiled
code (their pieces take those bodies). The tensor- and context-parallel collectives are graph breaks that run
eagerly (``tensor_parallel/mappings.py`` says why), so compiled layers communicate exactly as eager ones at every
tensor-, sequence- and context-parallel size, and inductor fuses what lies between two collectives. An MoE layer
compiles its attention block only: token dispatch reads counts on the host.

Dropout is drawn by PyTorch's eager generator inside the graph (inductor's ``fallback_random``), so the masks
are the eager ones: tensor-parallel ranks agree where they must and differ where they must, and a compiled
run equals an eager one exactly in distribution and, on the CPU, bit for bit.

Recompiles: all layers of one shape share one graph per body (the module is an input, not a constant). A new
input shape (a ragged last batch, validation's other batch size) compiles once more with that dimension
dynamic (``torch.compile``'s automatic dynamic shapes), and evaluation (no grad) has its own graph: a
handful per body, within dynamo's ``recompile_limit``, all in the first epoch (a two-layer fit with a ragged last
batch and another validation batch size: 13 graphs, or 8 in micro-batches of 2, and none after; the test in
tests/unit/transformer/test_compile.py fails on a per-step guard).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn

COMPILED_BODIES = ("_forward", "_attention_block", "_mlp_block")
COMPILE_KEYS = ("backend", "mode", "options", "dynamic", "fullgraph")   # torch.compile's, passed through

CompileLayers = Union[bool, str, Dict[str, Any], None]


def check_compile_layers(value: CompileLayers) -> Union[bool, str, Dict[str, Any]]:
    """``compile_layers``: True, False, ``"auto"`` (None means ``"auto"``), or a dict of ``torch.compile``
    keywords (compiled, with them: ``{"mode": "max-autotune-no-cudagraphs"}``, ``{"backend": "aot_eager"}``)."""
    if value is None:
        return "auto"
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(f"compile_layers={value!r}: {unknown} are not torch.compile keywords this takes; use "
                             f"{list(COMPILE_KEYS)}.")
        return dict(value)
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"compile_layers={value!r} is not one of True, False, 'auto' (compile every transformer layer; "
                     f"run them eagerly; compile on CUDA devices only) or a dict of torch.compile keywords.")


def resolve_compile_layers(value: CompileLayers, device: torch.device, cp: int = 1) -> Optional[Dict[str, Any]]:
    """The ``torch.compile`` keywords to compile the layers with, or None (eager).

    ``"auto"`` compiles where it measured faster: on CUDA devices at context-parallel size 1 the layers whose
    calls carry enough work (:func:`auto_compiles`, decided at a layer's first call), tensor parallelism,
    ``pipeline_schedule="zb-h1"`` and ``cuda_graph="partial"`` included (the collectives stay eager,
    tensor_parallel/mappings.py; the deferring linears are traced, tensor_parallel/deferred_wgrad.py). Not inside
    ``cuda_graph="full"`` (:func:`apply_compile_layers`): the graph replays the launches, so compiling gains only
    the fusion (BERT-base: 4.23 vs 4.31 ms a step), and capturing compiled BERT-base layers failed in 2 of 5 runs on
    an H200 (``cudaErrorStreamCaptureImplicit``, not yet traced). At cp > 1 compiled layers equal eager on GPUs but
    measured slower (the Llama-1B shape at cp2: 594.9 vs 471.6 ms a step). ``True`` or keywords compile at every
    width and layout. On the CPU ``"auto"`` does not compile (compiling costs more than it saves for the CPU's tiny
    test models). benchmarks/RESULTS.md has the measurements."""
    value = check_compile_layers(value)
    if value == "auto":
        return {} if device.type == "cuda" and cp == 1 else None
    if value is False:
        return None
    return value if isinstance(value, dict) else {}


def _uses_dropout(layer: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in layer.modules()) or \
        getattr(getattr(getattr(layer, "attention", None), "config", None), "attention_dropout", 0.0) > 0


def compiled_bodies(layer: nn.Module) -> List[str]:
    """The bodies compiled on this instance: those it holds as attributes of its own (the class has the eager ones)."""
    return [name for name in COMPILED_BODIES if name in vars(layer)]


#: the submodule each sub-block body runs (``TransformerLayer._attention_block`` / ``_mlp_block``)
BODY_MODULES = {"_attention_block": "attention", "_mlp_block": "mlp"}


def compiled_modules(layer: nn.Module) -> List[nn.Module]:
    """The modules of ``layer`` whose forward runs inside compiled code: the layer itself when it or its
    ``_forward`` is compiled, else the attention and/or MLP of its compiled sub-block bodies (an MoE layer: its
    attention only, see :func:`compile_layer`); none when it runs eagerly."""
    bodies = compiled_bodies(layer)
    if getattr(layer, "_compiled_call_impl", None) is not None or "_forward" in bodies:
        return [layer]
    return [getattr(layer, BODY_MODULES[name]) for name in bodies if name in BODY_MODULES]


def compile_layer(layer: nn.Module, **compile_kwargs: Any) -> List[str]:
    """Compile ``layer``'s bodies in place with ``torch.compile(**compile_kwargs)`` (see the module docstring);
    returns the names compiled. A layer already compiled (bodies, or the module itself) is left as it is."""
    compiled = compiled_bodies(layer)
    if compiled:
        return compiled
    if getattr(layer, "_compiled_call_impl", None) is not None:   # module.compile() (Float8Config(compile_layers))
        return []
    from ..tensor_parallel.mappings import prepare_for_compile

    prepare_for_compile()   # the collectives' graph breaks, made before tracing
    names = _bodies_to_compile(layer)
    kwargs = dict(compile_kwargs)
    if kwargs.get("backend", "inductor") == "inductor" and _uses_dropout(layer):
        # the eager generator's masks (see the module docstring)
        kwargs["options"] = {"fallback_random": True, **(kwargs.get("options") or {})}
    for name in names:
        setattr(layer, name, torch.compile(getattr(layer, name), **kwargs))
    return names


def compile_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """Compile every ``TransformerLayer`` in ``model`` (see :func:`compile_layer`); returns how many."""
    from .layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        compile_layer(layer, **compile_kwargs)
    return len(layers)


#: ``"auto"`` compiles a layer whose calls do at least this much work: tokens per call (this rank's) x hidden
#: size squared, which the layer's matmul FLOPs are proportional to. Below it a layer is host-bound: inductor
#: launches its kernels from Python (~30 us each, eager PyTorch ~5 us), which costs more than the fusion saves.
#: BERT-base, 512 tokens x 768^2 = 3.0e8, through the Trainer on one H200: eager layers 34.4 ms a step, compiled
#: 48.8 ms; under ``cuda_graph="partial"`` 9.9 vs 11.3 ms. Compiled measured faster: GPT-1.3B and the Llama
#: shapes (>= 3.4e10), and at the chat recipe's Qwen2.5-0.5B shape (8192 x 896^2 = 6.6e9) a plain loop's compiled
#: decoder layers ran 1.37x its eager ones (benchmarks/RESULTS.md).
AUTO_MIN_LAYER_WORK = 2 ** 30


def auto_compiles(tokens: int, hidden_size: int) -> bool:
    """Whether ``"auto"`` compiles a layer called on ``tokens`` tokens of ``hidden_size`` (see
    :data:`AUTO_MIN_LAYER_WORK`)."""
    return tokens * hidden_size ** 2 >= AUTO_MIN_LAYER_WORK


class _DecideOnFirstCall:
    """A layer's body under ``"auto"`` until the layer's first call, which shows the token count a setup cannot
    know: that call binds every body of the layer compiled or eager (:func:`auto_compiles`), calls ``on_bound(layer)``
    (the strategy decides the layer's gradient-accumulation fusion default again there: setup had counted these
    bodies as compiled) and runs."""

    def __init__(self, layer: nn.Module, name: str, compile_kwargs: Dict[str, Any],
                 report: Optional[Callable[[str], None]], on_bound: Optional[Callable[[nn.Module], Any]]) -> None:
        # the layer itself, not a weak reference: a deep copy of the layer then decides for the copy
        self.layer, self.name, self.compile_kwargs = layer, name, compile_kwargs
        self.report, self.on_bound = report, on_bound

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer
        for name in [n for n in COMPILED_BODIES if isinstance(vars(layer).get(n), _DecideOnFirstCall)]:
            delattr(layer, name)
        tokens, width = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
        compiled = auto_compiles(tokens, width)
        if self.report is not None and getattr(layer, "layer_number", None) == 1:   # one line a model
            self.report(f"compile_layers='auto': {tokens} tokens of width {width} a call, tokens x width^2 = "
                        f"{tokens * width ** 2:.1e} (compiled from {AUTO_MIN_LAYER_WORK:.1e}) -> layers " +
                        ("compiled" if compiled else "eager (host-bound; compile_layers=True compiles them anyway)"))
        if compiled:
            compile_layer(layer, **self.compile_kwargs)
        if self.on_bound is not None:
            self.on_bound(layer)
        return getattr(layer, self.name)(hidden, *args, **kwargs)


def _bodies_to_compile(layer: nn.Module) -> List[str]:
    from ..moe.layer import MoELayer

    # an MoE layer: its attention block only (token dispatch reads counts on the host)
    return ["_attention_block"] if isinstance(getattr(layer, "mlp", None), MoELayer) else list(COMPILED_BODIES)


def apply_compile_layers(model: nn.Module, setting: CompileLayers, device: torch.device, cp: int = 1,
                         full_graph: bool = False, report: Optional[Callable[[str], None]] = None,
                         on_bound: Optional[Callable[[nn.Module], Any]] = None) -> int:
    """The strategy's ``compile_layers`` switch on ``model`` for ``device``, the layout and whether a
    full-iteration graph replays the step (see :func:`resolve_compile_layers`): how many layers it compiled, or
    under ``"auto"`` left to decide at their first call (:class:`_DecideOnFirstCall`; ``report`` gets one line
    saying what the model's first layer decided, ``on_bound`` each layer once its bodies are bound)."""
    from .layer import TransformerLayer

    kwargs, automatic = resolve_compile_layers(setting, device, cp), check_compile_layers(setting) == "auto"
    if kwargs is None or (full_graph and automatic):
        return 0
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        if not automatic:
            compile_layer(layer, **kwargs)
        elif not compiled_bodies(layer) and getattr(layer, "_compiled_call_impl", None) is None:
            for name in _bodies_to_compile(layer):
                setattr(layer, name, _DecideOnFirstCall(layer, name, kwargs, report, on_bound))
    return len(layers)


def uncompile_layer(layer: nn.Module) -> None:
    """Undo :func:`compile_layer`: the bodies are the class's eager methods again."""
    for name in compiled_bodies(layer):
        delattr(layer, name)
