"""Per-layer ("partial") CUDA graphs, captured in the pipeline schedule's order (seed 003).

After ``warmup_steps`` eager training steps (which also record what each layer is called with),
every graphed piece of every layer gets one forward and one backward graph *per micro-batch*,
captured by walking the step's ``schedule_order`` exactly as the executor will run it. Why per
micro-batch and in that order: all graphs share one memory pool, and a graph captured after some
memory was released may reuse it; replaying in the capture order guarantees that memory is
never still needed when a later graph overwrites it. What keeps memory proportional to the
pipeline depth instead of the micro-batch count:

- static input buffers follow ``plan.static_buffer_plan``: a forward takes a buffer whose
  backward already ran (number of buffers = forwards in flight, ``plan.max_in_flight``);
- consecutive pieces are chained: a piece's input *is* the previous graph's output (no buffer,
  no copy), and its input gradient is the previous graph's output-gradient buffer;
- once a micro-batch's backward is captured, its graph outputs are held only weakly, so the
  next micro-batches' graphs reuse that pool memory (seed 003's ``make_weak_ref``);
- gradient buffers for outputs that leave the graph chain are shared by all micro-batches.

Layers take part through the graphable-layer protocol (``transformer/graphable.py``): they name
their pieces and route the pieces' calls to what ``set_graphed`` hands them. At replay those calls
go to the graph of the current micro-batch (counted per piece); evaluation, ``torch.no_grad`` and a
step whose order differs from the captured one run eagerly. Dropout inside graphs draws from
registered generator states and reproduces eager's masks (see ``rng.py``).

Limits: parameters must be updated in place (optimizers do; re-materialising ``param.data``
breaks the graphs); forward pre-hooks of graphed submodules are called by hand at replay with
empty inputs (for parameter gathers); a graph's outputs are valid until the micro-batch's backward
(do not keep layer outputs across steps); ``recompute_layers`` is refused; MoE routers' balancing
loss scale and ``aux_losses`` come from the capture (a changed ``graph_constants()`` value, such
as that scale, makes steps run eagerly); parameters' tensor hooks run inside the backward graph as they
were at the capture (a step where they changed runs eagerly, checked once a step); parameter gradients are delivered by the
replays themselves (``runner.py``), not by autograd's accumulators.

Usage (what the strategy does)::

    graphs = PartialCudaGraphs(layer_chunks(model, num_chunks), scope="layer", warmup_steps=2,
                               rng_tracker=get_rng_tracker(state))
    for each training step:
        graphs.begin_step(schedule_order(num_microbatches, pp_size, pp_rank, num_chunks, group))
        forward_backward(...)          # layers replay their graphs
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..tensor_parallel.random import RNGStatesTracker
from ..transformer.graphable import missing_methods
from .backend import make_backend
from .errors import CudaGraphError
from .plan import max_in_flight, microbatches_per_chunk, num_chunks, order_steps, static_buffer_plan
from .rng import prepare_tracker, preserved_rng
from .runner import MicrobatchGraphs, mark_pool_owned, shared_params
from .scopes import Entry, layer_entries, normalize_scope
from .tree import TensorSpec, first_difference, signature


@dataclass
class _EntryState:
    entry: Entry
    chunk: int
    position: int                               # index among the chunk's entries
    signature: Optional[Tuple[Any, ...]] = None  # of the arguments seen during warm-up
    autocast: Optional[Tuple[str, Optional[torch.dtype]]] = None   # (device type, autocast dtype or None when off)
    conflict: Optional[str] = None
    runners: List[MicrobatchGraphs] = field(default_factory=list)
    calls: int = 0                              # graphed calls this step = the micro-batch index


class PartialCudaGraphs:
    """Per-layer forward/backward CUDA graphs for the layers of this rank's model chunks.

    - ``layer_chunks[c]``: the layers of local chunk ``c`` in the order they run, back to back
      (e.g. ``TransformerBlock.layers``; :func:`layer_chunks` finds them); each implements
      :class:`~lightning_megatron.cuda_graphs.GraphableLayer`. With
      ``chain_layers=False`` no graph takes its input from the previous one (use it when other
      code runs between the layers).
    - ``scope``: ``"layer"``, ``"block"`` (the chunks' containers, from ``layer_chunks(model, scope="block")``)
      or a list of ``"attn"``, ``"mlp"``, ``"moe_router"``,
      ``"moe_preprocess"`` (see ``scopes.py``).
    - ``warmup_steps``: eager training steps before the capture (>= 1: they record the inputs).
    - ``rng_tracker``: the model's RNG tracker (``tensor_parallel.get_rng_tracker()``); made graph-safe.
    - ``backend``: ``"cuda"``, or ``"eager"`` to run the same bookkeeping without graphs.
    """

    def __init__(self, layer_chunks: Sequence[Sequence[nn.Module]], *, scope: Union[None, str, Sequence[str]] = "layer",
                 warmup_steps: int = 1, rng_tracker: Optional[RNGStatesTracker] = None, backend: str = "cuda",
                 chain_layers: bool = True, capture_warmup_iters: int = 1) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r}: partial graphs need at least 1 eager step to "
                             f"learn what each layer is called with; use cuda_graph_warmup_steps >= 1.")
        if not layer_chunks or not any(len(c) for c in layer_chunks):
            raise ValueError("layer_chunks has no layers; pass each local chunk's layers, e.g. "
                             "[model.decoder.layers] (layer_chunks(model) finds them).")
        self.scope = normalize_scope(scope)
        self.warmup_steps, self.backend_name = warmup_steps, backend
        self.capture_warmup_iters = capture_warmup_iters
        self.rng_tracker = rng_tracker
        prepare_tracker(rng_tracker, backend)
        self.chunks: List[List[_EntryState]] = []
        for c, layers in enumerate(layer_chunks):
            entries: List[Entry] = []
            for i, layer in enumerate(layers):
                entries.extend(layer_entries(layer, i, self.scope))
            for prev, entry in zip(entries, entries[1:]):
                entry.chained = chain_layers and prev.ends_cleanly and entry.first_segment == prev.last_segment + 1
            self.chunks.append([_EntryState(e, c, j) for j, e in enumerate(entries)])
        # a chunk's layers run under the tracker's fork when they are sequence-parallel (the block forks)
        self.sequence_parallel = [any(s.entry.sequence_parallel for s in chunk) for chunk in self.chunks]
        self.order: Optional[Tuple[int, ...]] = None
        self.mode = "record"        # record (warm-up) | replay | eager
        self.steps_seen = 0
        self.backend: Any = None
        self.static_buffers = 0                               # what the capture allocated (see stats())
        self.static_buffer_slots: Dict[Any, int] = {}
        self.max_in_flight: Optional[int] = None
        self._constants: Dict[Tuple[int, str], Any] = {}
        self._constant_layers: List[Any] = []   # the layers with constants, found at the capture
        self._warned: set = set()
        self._install()

    # -- public --------------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        return self.order is not None

    def begin_step(self, order: Sequence[int]) -> None:
        """Call before each training step's forward-backward with its ``schedule_order``.

        Counts warm-up steps, captures when they are done, and decides whether this step replays
        (same order and constants as captured) or runs eagerly.
        """
        order = tuple(order)
        for state in self._states():
            state.calls = 0
        if self.order is not None:   # captured
            reason = None
            if order != self.order:
                reason = (f"the schedule order changed (captured for {microbatches_per_chunk(self.order)} "
                          f"micro-batches, now {microbatches_per_chunk(order)}); this step runs eagerly")
            elif self._current_constants() != self._constants:
                reason = ("a constant baked into the graphs changed (MoE aux_loss_scale); this step runs eagerly. "
                          "Keep the micro-batch count fixed")
            elif any(s.runners[0].hooks_changed() for s in self._states() if s.runners):
                reason = ("a tensor hook (register_hook) on a graphed parameter was added or removed after the "
                          "capture, whose backward graphs run the hooks of then; this step runs eagerly. Register "
                          "parameter hooks before the first training step")
            self.mode = "replay" if reason is None else "eager"
            if reason is not None:
                self._warn_once(reason, reason)
            return
        if self.steps_seen < self.warmup_steps:
            self.steps_seen += 1
            self.mode = "record"
            return
        self.capture(order)
        self.mode = "replay"

    def capture(self, order: Sequence[int]) -> None:
        """Capture every piece's graphs for ``order`` (normally called by :meth:`begin_step`)."""
        order = tuple(order)
        steps = order_steps(order)
        if any(s.is_forward for s in steps) and not any(not s.is_forward for s in steps):
            raise CudaGraphError("order has no backward: partial graphs are for training steps; pass the "
                                 "training schedule_order (forward_only=False).")
        if num_chunks(order) != len(self.chunks):
            raise CudaGraphError(f"the order uses {num_chunks(order)} model chunks but layer_chunks has "
                                 f"{len(self.chunks)}; pass one list of layers per local chunk.")
        num_mb = microbatches_per_chunk(order)
        for state in self._states():
            if state.signature is None:
                raise CudaGraphError(
                    f"{state.entry.piece.name} (chunk {state.chunk}) never ran a training forward during the "
                    f"{self.warmup_steps} warm-up step(s): call begin_step(order) before each training step and "
                    f"let at least one run eagerly before the capture.")
            if state.conflict is not None:
                raise CudaGraphError(
                    f"{state.entry.piece.name} saw inputs of different shapes during warm-up ({state.conflict}); "
                    f"CUDA graphs need static shapes: use a fixed sequence length and drop_last=True, or "
                    f"cuda_graph=None.")
        self.backend = make_backend(self.backend_name, prepare_tracker(self.rng_tracker, self.backend_name))
        keys = [tuple(s.signature for s in chunk if not s.entry.chained) for chunk in self.chunks]
        plan = static_buffer_plan(order, keys)
        runners: Dict[Tuple[int, int, int], MicrobatchGraphs] = {}
        buffers: Dict[Tuple[Any, int, int], List[Optional[torch.Tensor]]] = {}
        grad_buffers: Dict[Tuple[Any, int, int], torch.Tensor] = {}
        modules = [s.entry.layer for s in self._states()]
        with preserved_rng(self.rng_tracker), _preserved_buffers(modules), self.backend.session():
            self._warm_up()
            pending: Optional[MicrobatchGraphs] = None
            for step in steps:
                chunk, mb = self.chunks[step.chunk], step.microbatch
                label = lambda s: f"{s.entry.piece.name} (chunk {s.chunk}, micro-batch {mb})"
                if step.is_forward:
                    prev: Optional[MicrobatchGraphs] = None
                    for s in chunk:
                        assert s.signature is not None   # checked above
                        slot = plan.slot[(step.chunk, mb)]
                        key = (keys[step.chunk], s.position, slot)
                        if key not in buffers:   # a chained piece's first input is the previous output
                            buffers[key] = _static_inputs(s.signature, skip_first=s.entry.chained)
                        inputs = list(buffers[key])
                        if s.entry.chained and prev is not None:
                            first = prev.static_outputs[0].detach().requires_grad_(_requires_grad(s.signature, 0))
                            inputs[0] = mark_pool_owned(first)
                        runner = MicrobatchGraphs(s.entry.piece, inputs, self.backend, label(s),
                                                  context=_autocast_context(s.autocast))
                        with self._rng_context(step.chunk):
                            runner.capture_forward()
                        runners[(step.chunk, mb, s.position)] = runner
                        prev = runner
                else:
                    after: Optional[MicrobatchGraphs] = None
                    for s in reversed(chunk):
                        runner = runners[(step.chunk, mb, s.position)]
                        grads: List[Optional[torch.Tensor]] = []
                        for i, out in enumerate(runner.static_outputs):
                            if i not in runner.differentiable:
                                grads.append(None)
                            elif i == 0 and after is not None and after.grad_input_positions[:1] == [0] \
                                    and chunk[s.position + 1].entry.chained and after.static_grad_inputs[0] is not None:
                                grads.append(mark_pool_owned(after.static_grad_inputs[0]))   # the chain: no copy
                            else:
                                gkey = (keys[step.chunk], s.position, i)
                                if gkey not in grad_buffers:
                                    grad_buffers[gkey] = torch.zeros_like(out)
                                grads.append(grad_buffers[gkey])
                        with self._rng_context(step.chunk):
                            runner.capture_backward(grads)
                        after = runner
                    if pending is not None:
                        pending.weaken_input_grad()
                    for s in chunk:
                        runners[(step.chunk, mb, s.position)].weaken(keep_input_grad=s.position == 0)
                    pending = runners[(step.chunk, mb, chunk[0].position)] if chunk else None
        shared = shared_params([s.entry.piece for s in self._states()])
        for state in self._states():
            state.runners = [runners[(state.chunk, mb, state.position)] for mb in range(num_mb)]
            if any(id(p) in shared for p in state.entry.piece.params):   # autograd sums them before one hook call
                if any(runner.tensor_hooks for runner in state.runners):
                    raise CudaGraphError(
                        f"{state.entry.piece.name} shares a parameter with another graphed piece and its parameters "
                        f"have tensor hooks (register_hook): the captured backward runs them and autograd would run "
                        f"them again. Register the hooks with register_post_accumulate_grad_hook, or set "
                        f"cuda_graph=None.")
                for runner in state.runners:
                    runner.grads_by_hand = False
        self.order = order
        # asked every step: only the layers that had constants at the capture (a dense layer's walk over its
        # modules for routers is ~20 us of host time a layer and step)
        layers = dict.fromkeys(s.entry.graphable for s in self._states())   # once each, however many entries
        self._constant_layers = [layer for layer in layers if layer.graph_constants()]
        self._constants = self._current_constants()
        self.static_buffers = sum(1 for v in buffers.values() for t in v if t is not None)
        self.static_buffer_slots = plan.num_buffers
        self.max_in_flight = max_in_flight(order)
        self.backend.synchronize()

    def remove(self) -> None:
        """Give the layers their eager calls back and drop every graph."""
        for state in self._states():
            state.entry.graphable.set_graphed(state.entry.method, None)
            state.runners = []
        self.order, self.backend = None, None

    def stats(self) -> Dict[str, Any]:
        """What was captured: graphs, static input buffers (by buffer key), forwards in flight."""
        return {"graphs": 2 * sum(len(s.runners) for s in self._states()),
                "static_input_slots": list(self.static_buffer_slots.values()),
                "static_input_buffers": self.static_buffers,
                "max_in_flight": self.max_in_flight,
                "pieces": [s.entry.piece.name for s in self._states()]}

    # -- interception --------------------------------------------------------------------------
    def _install(self) -> None:
        for state in self._states():
            layer, method = state.entry.graphable, state.entry.method
            previous = layer.set_graphed(method, self._make_call(state))
            if previous is not None:
                layer.set_graphed(method, previous)
                raise CudaGraphError(f"{type(layer).__name__}.{method} of {state.entry.piece.name} is already "
                                     f"taken over (two PartialCudaGraphs on one model?); call remove() first.")

    def _make_call(self, state: _EntryState) -> Any:
        entry = state.entry

        def call(*args: Any, **kwargs: Any) -> Any:
            args = _bind(entry, args, kwargs)
            if not (entry.layer.training and torch.is_grad_enabled()) or self.mode == "eager":
                return entry.eager(*args)
            if self.mode == "record":
                self._record(state, args)
                return entry.eager(*args)
            mb = state.calls
            state.calls += 1
            if mb >= len(state.runners):
                raise CudaGraphError(
                    f"{entry.piece.name} ran forward {mb + 1} times in this step but the graphs were captured for "
                    f"{len(state.runners)} micro-batches: call begin_step(order) before every training step.")
            runner = state.runners[mb]
            if _autocast_state(args) != state.autocast:
                self._warn_once(("autocast", entry.piece.name),
                                f"{entry.piece.name}: autocast was {state.autocast} during warm-up, now "
                                f"{_autocast_state(args)}; running it eagerly")
                return entry.eager(*args)
            if signature(args) != state.signature:
                assert state.signature is not None   # recorded before the capture
                self._warn_once(("shape", state.entry.piece.name),
                                f"{entry.piece.name}: {first_difference(state.signature, signature(args))}; "
                                f"running it eagerly (graphs need static shapes)")
                return entry.eager(*args)
            outputs = runner.apply(args)
            return entry.finish(args, outputs, runner.aux)

        return call

    def _record(self, state: _EntryState, args: Tuple[Any, ...]) -> None:
        sig, autocast = signature(args), _autocast_state(args)
        if state.signature is None:
            state.signature, state.autocast = sig, autocast
        elif state.conflict is None and sig != state.signature:
            state.conflict = first_difference(state.signature, sig)
        elif state.conflict is None and autocast != state.autocast:
            state.conflict = f"autocast {state.autocast} and {autocast}"

    # -- capture helpers -----------------------------------------------------------------------
    def _warm_up(self) -> None:
        """Run each piece forward and backward on sample inputs on the capture stream (lazy inits)."""
        for chunk in self.chunks:
            for state in chunk:
                assert state.signature is not None   # capture checked it
                for _ in range(self.capture_warmup_iters):
                    inputs = _static_inputs(state.signature)
                    with torch.enable_grad(), self._rng_context(state.chunk), _autocast_context(state.autocast)():
                        outputs, _ = state.entry.piece.fn(*inputs)
                    outs = [o for o in outputs if o.requires_grad]
                    targets = [t for t in inputs if t is not None and t.requires_grad] + \
                        [p for p in state.entry.piece.params if p.requires_grad]
                    if outs and targets:
                        torch.autograd.grad(outs, targets, [torch.ones_like(o) for o in outs], allow_unused=True)

    def _rng_context(self, chunk: int) -> Any:
        """Sequence-parallel blocks run their layers under the tracker's fork: capture them there too."""
        if self.sequence_parallel[chunk]:
            if self.rng_tracker is None:
                raise CudaGraphError("sequence-parallel layers draw dropout from the RNG tracker: pass "
                                     "rng_tracker=get_rng_tracker(state).")
            return self.rng_tracker.fork()
        return contextlib.nullcontext()

    def _current_constants(self) -> Dict[Tuple[int, str], Any]:
        return {(id(layer), name): value for layer in self._constant_layers
                for name, value in layer.graph_constants().items()}

    def _states(self) -> Iterator[_EntryState]:
        for chunk in self.chunks:
            yield from chunk

    def _warn_once(self, key: Any, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"partial CUDA graphs: {message}.", stacklevel=3)


def layer_chunks(model: nn.Module, num_chunks: int = 1,
                 scope: Union[None, str, Sequence[str]] = None) -> List[List[nn.Module]]:
    """The layers of each local chunk: those of the one container under ``model`` (per chunk) with
    ``graphable_layers()`` (``TransformerBlock``, ``PipelineStack``: see ``transformer/graphable.py``).
    With ``scope="block"`` the container itself, graphed whole (it must implement the graphable-layer protocol).

    With ``num_chunks > 1`` the model must hold a ``VirtualChunks`` (one block per chunk).
    """
    from ..pipeline.chunks import VirtualChunks

    whole = "block" in normalize_scope(scope)
    if num_chunks == 1:
        found = [m for m in model.modules() if callable(getattr(m, "graphable_layers", None))]
        if len(found) != 1:
            raise ValueError(f"found {len(found)} containers of graphable layers (TransformerBlock/PipelineStack) "
                             f"in {type(model).__name__}; layer_chunks needs exactly one per chunk. Pass the layers "
                             f"to PartialCudaGraphs yourself (chain_layers=False if other code runs between them).")
        container = found[0]
        if whole and missing_methods(container):
            raise ValueError(f"cuda_graph_scope='block' graphs the container of a chunk's layers whole, but "
                             f"{type(container).__name__} does not implement the graphable-layer protocol "
                             f"({', '.join(missing_methods(container))} missing); use cuda_graph_scope='layer'.")
        return [[container]] if whole else [list(container.graphable_layers())]  # type: ignore[operator]  # checked
    virtual = [m for m in model.modules() if isinstance(m, VirtualChunks)]
    if len(virtual) != 1 or len(virtual[0].chunks) != num_chunks:
        raise ValueError(f"num_chunks={num_chunks} needs one VirtualChunks module with {num_chunks} chunks in "
                         f"{type(model).__name__}; found {[len(v.chunks) for v in virtual]}.")
    return [layer_chunks(chunk, 1, scope)[0] for chunk in virtual[0].chunks]


# -- helpers -------------------------------------------------------------------------------------
# per-call layer inputs a graph does not take (they change every micro-batch): refused by name, never dropped
_UNGRAPHED_INPUTS = {"position_ids": "rotary positions", "document_ids": "packed documents' attention masks"}


def _bind(entry: Entry, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """Positional arguments in ``entry.arg_names`` order (missing trailing ones are None)."""
    names = entry.arg_names
    if names is None:
        if kwargs:
            raise CudaGraphError(f"{entry.piece.name} was called with keyword arguments {sorted(kwargs)}; "
                                 f"its GraphPiece has no arg_names, so it takes positional tensors only.")
        return tuple(args)
    if len(args) > len(names):
        raise CudaGraphError(f"{entry.piece.name}: {len(args)} positional arguments, expected at most {len(names)}.")
    values = list(args) + [None] * (len(names) - len(args))
    for key, value in kwargs.items():
        if key in _UNGRAPHED_INPUTS and key not in names:
            raise CudaGraphError(
                f"{entry.piece.name} was called with {key} ({_UNGRAPHED_INPUTS[key]}), but per-layer CUDA graphs "
                f"take only {list(names)}: the graph would replay the capture's attention. Use "
                f"cuda_graph_scope=['mlp'] (attention runs eagerly) or cuda_graph=None with {key}.")
        if key not in names[len(args):]:
            raise CudaGraphError(f"{entry.piece.name}: unexpected argument {key!r} (takes {list(names)}).")
        values[names.index(key)] = value
    return tuple(values)


def _autocast_state(args: Tuple[Any, ...]) -> Optional[Tuple[str, Optional[torch.dtype]]]:
    """(device type, autocast dtype or None when off) of a call, from its first tensor; None without one."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    if device is None:
        return None
    return device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _autocast_context(state: Optional[Tuple[str, Optional[torch.dtype]]]) -> Callable[[], Any]:
    """Capture under exactly the autocast the eager calls ran under (the ambient one does not reach a
    replay), without the weight-cast cache: a cast cached by one graph and read by another would tie
    their memory across replays (torch's rule for autocast with CUDA graphs)."""
    if state is None:
        return contextlib.nullcontext
    device, dtype = state
    if dtype is None:
        return lambda: torch.autocast(device, enabled=False)
    return lambda: torch.autocast(device, dtype=dtype, cache_enabled=False)


def _requires_grad(sig: Tuple[Any, ...], index: int) -> bool:
    spec = sig[index][1]
    return isinstance(spec, TensorSpec) and spec.requires_grad


def _static_inputs(sig: Tuple[Any, ...], skip_first: bool = False) -> List[Optional[torch.Tensor]]:
    """Sample tensors matching a recorded call signature; None where the call passed None (or skipped)."""
    inputs: List[Optional[torch.Tensor]] = []
    for i, (_, spec) in enumerate(sig):
        if skip_first and i == 0:
            inputs.append(None)
            continue
        if not isinstance(spec, TensorSpec):
            if spec.value is not None:
                raise CudaGraphError(f"graphed layers take tensors or None; got {spec} (pass it as a tensor or "
                                     f"bind it when building the layer).")
            inputs.append(None)
            continue
        if spec.dtype.is_floating_point:
            t = torch.randn(spec.shape, dtype=spec.dtype, device=spec.device)
        else:
            t = torch.ones(spec.shape, dtype=spec.dtype, device=spec.device)
        inputs.append(t.requires_grad_(spec.requires_grad))
    return inputs


@contextlib.contextmanager
def _preserved_buffers(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Undo what warm-up passes did to module buffers (e.g. MoE token counts)."""
    saved = {}
    for module in modules:
        for buf in module.buffers():
            if id(buf) not in saved:
                saved[id(buf)] = (buf, buf.detach().clone())
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved.values():
                buf.copy_(value)
