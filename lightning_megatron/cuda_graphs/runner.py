"""One graphed piece of a layer for one micro-batch: its forward graph, its backward graph, and the
autograd function that replays them in place of the eager code.

A forward replay copies the caller's inputs into the static inputs (skipped when the input *is*
the static input: the previous piece's output in a chain) and replays; the outputs handed back
are the static outputs. A backward replay copies the incoming gradients into the static gradient
buffers and replays. The parameters' static gradients are added into an existing ``.grad`` as they are, and
copied into a new one (the next replay overwrites them).

Delivered by hand: the autograd function takes one anchor tensor instead of the piece's parameters, and its
backward accumulates their gradients as ``AccumulateGrad`` would (``.grad`` set or added to, then the
parameters' post-accumulate hooks, e.g. the data-parallel buffers'). A block of 12 BERT layers has 192
parameters: as inputs they cost an autograd edge each at every forward and an accumulator node each at every
backward, ~1 ms of host time a step where the GPU needs ~4 (benchmarks/RESULTS.md). A parameter shared with
another graphed piece goes through autograd (``shared_params``: autograd sums its gradients before one hook
call); one used both inside a graph and by eager code gets its post-accumulate hooks called once for each.

Tensor hooks on parameters (``param.register_hook``) run inside the captured backward (``autograd.grad`` applies
them), so they are in the graph as they were at the capture and must not run again at delivery; a step where they
changed runs eagerly (``hooks_changed``, asked by ``PartialCudaGraphs.begin_step``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..tensor_parallel.grad_accumulation import run_post_accumulate_grad_hooks
from .errors import CudaGraphError

Outputs = Tuple[torch.Tensor, ...]


@dataclass
class Piece:
    """A graphable computation: ``fn(*args) -> (outputs tuple, aux)``.

    ``aux`` is Python state the eager code after the graph needs (e.g. MoE dispatch metadata);
    it is kept from the capture. ``params``: the parameters ``fn`` uses (their gradients leave the
    backward graph). ``hook_modules``: submodules whose forward pre-hooks must be called by hand
    at replay (their ``__call__`` does not run then).
    """

    name: str
    fn: Callable[..., Tuple[Outputs, Any]]
    params: List[nn.Parameter]
    hook_modules: List[nn.Module] = field(default_factory=list)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class MicrobatchGraphs:
    """Forward and backward graph of ``piece`` for one micro-batch, on fixed static tensors."""

    def __init__(self, piece: Piece, static_inputs: Sequence[Optional[torch.Tensor]], backend: Any,
                 label: str, context: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.piece, self.backend, self.label = piece, backend, label
        self.context = context                     # entered around the forward (e.g. autocast)
        self.static_inputs: List[Optional[torch.Tensor]] = list(static_inputs)
        self.params = [p for p in piece.params if p.requires_grad]
        self.fwd, self.bwd = backend.new_graph(), backend.new_graph()
        self.live: Optional[Outputs] = None        # outputs with autograd history, until the backward
        self.aux: Any = None
        self.static_outputs: Outputs = ()
        self.differentiable: List[int] = []        # outputs that carry gradient
        self.static_grad_outputs: List[Optional[torch.Tensor]] = []
        self.static_grad_inputs: List[Optional[torch.Tensor]] = []   # grad-requiring inputs, then params
        self.grad_input_positions: List[int] = [
            i for i, t in enumerate(self.static_inputs) if t is not None and t.requires_grad]
        # parameter gradients delivered by hand (see the module); False: through autograd (set by the capture for
        # parameters another graphed piece shares)
        self.grads_by_hand = bool(self.params)
        self._anchor: Optional[torch.Tensor] = None
        self._relayout: List[int] = []            # parameter gradients whose static strides differ from the param's
        self.tensor_hooks: Dict[int, Tuple[Any, ...]] = {}   # per parameter index, the tensor hooks the graph ran

    # -- capture -------------------------------------------------------------------------------
    def capture_forward(self) -> Outputs:
        def body() -> Outputs:
            with torch.enable_grad(), self.context():
                outputs, aux = self.piece.fn(*self.static_inputs)
            self.live, self.aux = tuple(outputs), aux
            return self.live

        self.static_outputs = tuple(self._capture(self.fwd, body, "forward"))
        assert self.live is not None   # body ran
        self.differentiable = [i for i, o in enumerate(self.live) if o.requires_grad]
        return self.static_outputs

    def capture_backward(self, static_grad_outputs: Sequence[Optional[torch.Tensor]]) -> None:
        self.static_grad_outputs = list(static_grad_outputs)
        for i in self.differentiable:
            if self.static_grad_outputs[i] is None:
                raise CudaGraphError(f"{self.label}: no gradient buffer for differentiable output {i}.")
        # grad_input_positions: the inputs that are tensors (requiring grad)
        targets = cast(List[torch.Tensor], [self.static_inputs[i] for i in self.grad_input_positions]) + self.params

        def body() -> Tuple[Optional[torch.Tensor], ...]:
            live = self.live
            if live is None:
                raise CudaGraphError(f"{self.label}: backward replayed before its forward.")
            self.live = None   # the autograd graph (and the saved activations) go with this backward
            outs = [live[i] for i in self.differentiable]
            grads = [self.static_grad_outputs[i] for i in self.differentiable]
            if not outs or not targets:
                return tuple(None for _ in targets)
            return torch.autograd.grad(outs, targets, grads, allow_unused=True)

        self.tensor_hooks = _tensor_hooks(self.params)   # the capture's autograd.grad runs them (see the module)
        self.static_grad_inputs = list(self._capture(self.bwd, body, "backward"))
        n = len(self.grad_input_positions)
        self._relayout = [i for i, (p, g) in enumerate(zip(self.params, self.static_grad_inputs[n:]))
                          if g is not None and g.stride() != p.stride()]

    def _capture(self, graph: Any, body: Callable[[], Any], phase: str) -> Any:
        try:
            return self.backend.capture(graph, body)
        except CudaGraphError:
            raise
        except Exception as exc:
            raise CudaGraphError(
                f"capturing the {phase} of {self.label} failed: {type(exc).__name__}: {str(exc).rstrip('.')}. "
                f"Code inside a CUDA graph must not synchronize with the host (.item(), .cpu(), .tolist(), "
                f"printing tensors, host-tensor copies) nor produce data-dependent shapes (e.g. dropless MoE over "
                f"several expert ranks: use pad_to_capacity or cuda_graph_scope 'moe_router'); or set "
                f"cuda_graph=None.") from exc

    def weaken(self, keep_input_grad: bool = False) -> None:
        """After the backward capture: hold graph-pool tensors only weakly, so later captures reuse them.

        Static inputs the caller owns (buffers outside the pool) stay. ``keep_input_grad`` keeps the
        first input's gradient alive (a later stage still has to receive it; released one backward later).
        """
        weak = self.backend.weak
        self.static_outputs = tuple(weak(t) for t in self.static_outputs)
        self.static_inputs = [weak(t) if t is not None and getattr(t, "_graph_pool_owned", False) else t
                              for t in self.static_inputs]
        self.static_grad_outputs = [weak(t) if t is not None and getattr(t, "_graph_pool_owned", False) else t
                                    for t in self.static_grad_outputs]
        kept = 1 if keep_input_grad and self.grad_input_positions else 0
        self.static_grad_inputs = [t if (i < kept or t is None) else weak(t)
                                   for i, t in enumerate(self.static_grad_inputs)]

    def weaken_input_grad(self) -> None:
        if self.static_grad_inputs and self.static_grad_inputs[0] is not None:
            self.static_grad_inputs[0] = self.backend.weak(self.static_grad_inputs[0])

    # -- replay ---------------------------------------------------------------------------------
    def replay_forward(self, inputs: Sequence[Optional[torch.Tensor]]) -> Outputs:
        for module in self.piece.hook_modules:   # their __call__ does not run at replay
            for key, hook in list(module._forward_pre_hooks.items()):
                if key in module._forward_pre_hooks_with_kwargs:
                    hook(module, (), {})
                else:
                    hook(module, ())
        with torch.no_grad():
            for static, given in zip(self.static_inputs, inputs):
                if static is None:
                    continue
                given = _present(given)   # the call's signature matched the capture's: a tensor where it had one
                if not _same_memory(static, given):
                    static.copy_(given)
        self.backend.replay(self.fwd)
        return self.static_outputs

    def replay_backward(self, grads: Sequence[Optional[torch.Tensor]]) -> Tuple[List[Optional[torch.Tensor]], ...]:
        with torch.no_grad():
            for i in self.differentiable:
                static, given = _present(self.static_grad_outputs[i]), grads[i]   # capture_backward checked it
                if given is None:
                    static.zero_()
                elif not _same_memory(static, given):
                    static.copy_(given)
        self.backend.replay(self.bwd)
        n = len(self.grad_input_positions)
        input_grads = [None if g is None else g.detach() for g in self.static_grad_inputs[:n]]
        return input_grads, list(self.static_grad_inputs[n:])   # the parameters': static, see fresh_copies

    def fresh_copies(self, static: Sequence[Optional[torch.Tensor]],
                     which: Optional[Sequence[int]] = None) -> List[Optional[torch.Tensor]]:
        """Copies of the parameters' static gradients (all, or those at ``which``) that may become ``.grad`` (the next
        replay overwrites the static ones): one multi-tensor kernel, in the parameter's layout where the static
        gradient's differs, as ``AccumulateGrad`` would make it."""
        out = list(static)
        wanted = range(len(out)) if which is None else which
        plain = [i for i in wanted if out[i] is not None and i not in self._relayout]
        if plain:
            for i, g in zip(plain, torch._foreach_mul([_present(out[i]) for i in plain], 1.0)):
                out[i] = g
        for i in self._relayout:
            if i in wanted:
                out[i] = torch.empty_like(self.params[i]).copy_(_present(out[i]))
        return out

    def hooks_changed(self) -> bool:
        """Whether the parameters' tensor hooks differ from those the captured backward ran."""
        if not self.tensor_hooks:   # none at the capture: the common case, one attribute read a parameter
            return any(p._backward_hooks for p in self.params)
        return _tensor_hooks(self.params) != self.tensor_hooks

    def apply(self, inputs: Sequence[Optional[torch.Tensor]]) -> Outputs:
        """Replay through autograd: gradients flow to the inputs and parameters as in eager mode."""
        if self.grads_by_hand:
            if self._anchor is None:
                self._anchor = torch.empty(0, device=self.params[0].device, requires_grad=True)
            return _Replay.apply(self, len(inputs), True, *inputs, self._anchor)
        return _Replay.apply(self, len(inputs), False, *inputs, *self.params)


def _tensor_hooks(params: Sequence[nn.Parameter]) -> Dict[int, Tuple[Any, ...]]:
    return {i: tuple(p._backward_hooks.values()) for i, p in enumerate(params) if p._backward_hooks}


def _present(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    """A tensor the graphs' bookkeeping guarantees (a static input where the capture had one, the gradient
    buffer of a differentiable output, a parameter gradient listed as present)."""
    assert tensor is not None
    return tensor


def mark_pool_owned(tensor: torch.Tensor) -> torch.Tensor:
    """Tag a static tensor that lives in the graph pool (chained inputs, gradient chains)."""
    tensor._graph_pool_owned = True  # type: ignore[attr-defined]  # runtime attribute
    return tensor


def shared_params(pieces: Sequence[Piece]) -> Set[int]:
    """The ids of the parameters more than one of ``pieces`` uses (their gradients go through autograd)."""
    seen: Set[int] = set()
    shared: Set[int] = set()
    for piece in pieces:
        for param in piece.params:
            (shared if id(param) in seen else seen).add(id(param))
    return shared


def accumulate_param_grads(runner: MicrobatchGraphs, static: Sequence[Optional[torch.Tensor]]) -> None:
    """What ``AccumulateGrad`` does for each of ``runner``'s parameters, given the backward graph's ``static``
    gradients: added straight into an existing ``.grad`` (one multi-tensor kernel for all), copied into a new one
    (``fresh_copies``); then the parameter's post-accumulate hooks run. Parameters frozen since the capture are left
    alone."""
    params = runner.params
    targets: List[torch.Tensor] = []
    added: List[torch.Tensor] = []
    new: List[int] = []
    delivered: List[nn.Parameter] = []
    for i, (param, grad) in enumerate(zip(params, static)):
        if grad is None or not param.requires_grad:
            continue
        if param.grad is None:
            new.append(i)
        else:
            targets.append(param.grad)
            added.append(grad)
        delivered.append(param)
    if targets:   # before any later replay reuses the static memory: same stream, enqueued first
        torch._foreach_add_(targets, added)
    if new:
        fresh = runner.fresh_copies(static, new)
        for i in new:
            params[i].grad = fresh[i]
    for param in delivered:
        run_post_accumulate_grad_hooks(param)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: MicrobatchGraphs, num_inputs: int, by_hand: bool,
                *tensors: Optional[torch.Tensor]) -> Outputs:
        ctx.runner, ctx.num_inputs, ctx.by_hand = runner, num_inputs, by_hand
        outputs = runner.replay_forward(tensors[:num_inputs])
        returned = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(returned) if i not in runner.differentiable])
        return returned

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        runner: MicrobatchGraphs = ctx.runner
        input_grads, static = runner.replay_backward(grads)
        per_input: List[Optional[torch.Tensor]] = [None] * ctx.num_inputs
        for position, grad in zip(runner.grad_input_positions, input_grads):
            per_input[position] = grad
        if ctx.by_hand:
            accumulate_param_grads(runner, static)
            return (None, None, None, *per_input, None)
        return (None, None, None, *per_input, *runner.fresh_copies(static))
