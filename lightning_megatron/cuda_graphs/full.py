"""Full-iteration CUDA graphs (seed 004): the whole forward-backward of a step in one graph.

``FullCudaGraphWrapper(fn)`` wraps a ``forward_backward``-like callable. The first
``warmup_steps`` calls per mode run eagerly; the next one captures ``fn`` on static copies of its
arguments and replays it; later calls copy their tensors into those copies and replay. Training
and validation (``training=False``) each get one graph, sharing one memory pool. With pipeline
parallelism the graph holds every micro-batch of every stage of this rank, p2p included. The
optimizer step stays outside.

What a graph bakes in, and how this stays correct:

- shapes, dtypes and every non-tensor argument: a call that differs raises
  :class:`CudaGraphShapeError` naming the argument (``on_shape_change="eager"`` runs it eagerly);
- gradients: they accumulate into static tensors inside the graph. Before each training replay
  every parameter's ``.grad`` becomes its static tensor -- zeroed if ``.grad`` was None, loaded
  from ``.grad`` if that is another tensor -- so ``zero_grad(set_to_none=True)``, gradient
  accumulation and code that swaps ``.grad`` all behave as in eager mode;
- parameters are read in place: optimizers must update them in place (all torch optimizers do);
- the result: ``fn``'s return value with its tensors refreshed by each replay (cloned by default,
  so a kept loss is not overwritten by the next step); Python side effects of ``fn`` (appending
  to lists, ``self.log``) happen at the capture only -- return everything you need;
- RNG: the default CUDA generator and the RNG tracker's states are registered with the graphs, so
  dropout draws what eager steps would.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..tensor_parallel.random import RNGStatesTracker
from .backend import make_backend
from .errors import CudaGraphError, CudaGraphShapeError
from .rng import prepare_tracker, preserved_rng
from .tree import first_difference, map_tensors, signature, tensors_of

ON_SHAPE_CHANGE = ("error", "eager")


@dataclass
class _Mode:
    calls: int = 0
    graph: Any = None
    signature: Any = None
    static: Any = None      # (args, kwargs) with static tensors
    result: Any = None


class FullCudaGraphWrapper:
    """Capture ``forward_backward_fn`` whole, once for training and once for validation.

    - ``params``: the parameters whose gradients the training graph produces (required to train).
    - ``warmup_steps``: eager calls per mode before the capture (lazy initialisation, NCCL setup).
    - ``rng_tracker``: the model's RNG tracker; made graph-safe and registered with the graphs.
    - ``backend``: ``"cuda"``, or ``"eager"`` to run the same bookkeeping without graphs.
    - ``clone_outputs``: return copies of the static result (default) rather than the static tensors.
    """

    def __init__(self, forward_backward_fn: Callable[..., Any], *, params: Iterable[nn.Parameter] = (),
                 warmup_steps: int = 1, rng_tracker: Optional[RNGStatesTracker] = None, backend: str = "cuda",
                 on_shape_change: str = "error", clone_outputs: bool = True) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0 (1 or more lets lazy "
                             f"initialisation happen outside the graph).")
        if on_shape_change not in ON_SHAPE_CHANGE:
            raise ValueError(f"on_shape_change={on_shape_change!r} is not one of {ON_SHAPE_CHANGE}.")
        self.fn = forward_backward_fn
        self.params: List[nn.Parameter] = [p for p in params if p.requires_grad]
        self.warmup_steps, self.backend_name = warmup_steps, backend
        self.rng_tracker = rng_tracker
        self.on_shape_change, self.clone_outputs = on_shape_change, clone_outputs
        prepare_tracker(rng_tracker, backend)
        self.backend: Any = None
        self.modes: Dict[str, _Mode] = {"training": _Mode(), "validation": _Mode()}
        self.static_grads: List[torch.Tensor] = []
        self._warned = False

    def is_captured(self, training: bool = True) -> bool:
        return self.modes["training" if training else "validation"].graph is not None

    def __call__(self, *args: Any, training: bool = True, **kwargs: Any) -> Any:
        mode = self.modes["training" if training else "validation"]
        if mode.graph is None and mode.calls < self.warmup_steps:
            mode.calls += 1
            return self.fn(*args, **kwargs)
        sig = signature((args, kwargs))
        if mode.graph is None:
            self._capture(mode, training, args, kwargs, sig)
        elif sig != mode.signature:
            difference = first_difference(mode.signature, sig)
            if self.on_shape_change == "error":
                raise CudaGraphShapeError(
                    f"the {'training' if training else 'validation'} graph was captured for other inputs: "
                    f"{difference} (paths index (args, kwargs)). Full-iteration CUDA graphs need static shapes "
                    f"and arguments: use drop_last=True and a fixed sequence length, pass values that change "
                    f"as tensors, use on_shape_change='eager', or cuda_graph=None.")
            if not self._warned:
                self._warned = True
                warnings.warn(f"full CUDA graph: {difference}; running this step eagerly.", stacklevel=2)
            return self.fn(*args, **kwargs)
        else:
            with torch.no_grad():
                for static, given in zip(tensors_of(mode.static), tensors_of((args, kwargs))):
                    static.copy_(given)
        if training:
            self._attach_grads()
        self.backend.replay(mode.graph)
        mode.calls += 1
        if self.clone_outputs:
            return map_tensors(lambda t: t.clone(), mode.result)
        return mode.result

    # -- internals -----------------------------------------------------------------------------
    def _capture(self, mode: _Mode, training: bool, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 sig: Any) -> None:
        if training and not self.params:
            raise CudaGraphError("FullCudaGraphWrapper(params=...) is empty: pass the model's parameters so their "
                                 "gradients live in static tensors the training graph accumulates into.")
        if self.backend is None:
            self.backend = make_backend(self.backend_name, prepare_tracker(self.rng_tracker, self.backend_name))
        mode.static = map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), (args, kwargs))
        mode.signature = sig
        if training:
            if not self.static_grads:
                self.static_grads = [torch.zeros_like(p) for p in self.params]
            self._attach_grads()
        before = [g.clone() for g in self.static_grads] if training else []
        graph = self.backend.new_graph()
        static_args, static_kwargs = mode.static
        with preserved_rng(self.rng_tracker):   # the eager backend executes the capture: undo its draws
            try:
                mode.result = self.backend.capture(graph, lambda: self.fn(*static_args, **static_kwargs))
            except Exception as exc:
                raise CudaGraphError(
                    f"capturing the {'training' if training else 'validation'} step failed: "
                    f"{type(exc).__name__}: {str(exc).rstrip('.')}. A full-iteration graph must not synchronize "
                    f"with the host (.item(), .cpu(), printing tensors, host-tensor copies), nor produce "
                    f"data-dependent shapes (dropless MoE: use pad_to_capacity); or use cuda_graph='partial' "
                    f"/ None.{_legacy_stream_hint(exc)}") from exc
        with torch.no_grad():
            for grad, value in zip(self.static_grads, before):
                grad.copy_(value)
        mode.graph = graph

    def _attach_grads(self) -> None:
        """Make every ``param.grad`` its static tensor, keeping eager accumulation semantics."""
        zero, dst, src = [], [], []
        for param, static in zip(self.params, self.static_grads):
            current = param.grad
            if current is None:
                zero.append(static)
            elif current is not static:
                dst.append(static)
                src.append(current)
            param.grad = static
        with torch.no_grad():
            if zero:
                torch._foreach_zero_(zero)
            if dst:
                torch._foreach_copy_(dst, src)


def _legacy_stream_hint(exc: BaseException) -> str:
    """What to try when the capture failed because something used the legacy default stream: seen (2 of 3 and 2 of 5
    runs on an H200) with torch.compile'd BERT layers inside the graph, never with eager layers."""
    chain: Optional[BaseException] = exc
    while chain is not None:
        if "legacy stream" in str(chain) or "StreamCaptureImplicit" in str(chain):
            return (" The capture touched the legacy default stream, which compiled layers inside a full-iteration "
                    "graph have done intermittently: with compile_layers=True, try compile_layers='auto' (it "
                    "leaves the layers eager under cuda_graph='full') or False.")
        chain = chain.__cause__ or chain.__context__
    return ""
