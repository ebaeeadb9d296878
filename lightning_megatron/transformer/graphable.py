"""The graphable-layer protocol: how a layer tells per-layer CUDA graphs what they may capture.

``cuda_graphs.PartialCudaGraphs`` knows layers only through these three methods, so it never reads
a layer's internals and any layer can be graphed -- ``TransformerLayer`` is one implementation. The
protocol lives with the layers (plain torch, no graph machinery) so that ``cuda_graphs`` depends on
``transformer`` and not the other way round; ``lightning_megatron.cuda_graphs`` re-exports it.

- ``graph_pieces(scope)``: the :class:`GraphPiece` s of the layer under ``scope`` (a frozenset of
  ``"layer"``, ``"attn"``, ``"mlp"``, ``"moe_router"``, ``"moe_preprocess"``), in the order they run;
  empty when nothing of the layer is in the scope. Raise (naming the fix) for a scope it cannot honour.
- ``set_graphed(entry, fn)``: from now on the layer's call ``entry`` (e.g. ``"forward"``) goes to
  ``fn`` with the same arguments (``fn=None``: back to eager). Returns the callable it replaces
  (None if none), so a second owner is detected. The layer itself routes the call, e.g.::

      def forward(self, x):
          graphed = self.graphed_calls.get("forward")
          return graphed(x) if graphed is not None else self._forward(x)

- ``graph_constants()``: host values baked into the graphs at capture (e.g. an MoE router's
  ``aux_loss_scale``); a step where they differ runs eagerly. Asked at every step of layers that had some
  at the capture only: which constants a layer has is fixed once its graphs exist.

A container that runs such layers one after another with nothing in between (``TransformerBlock``,
``PipelineStack``) says so with ``graphable_layers()``, the layers in the order they run: that is how
``cuda_graphs.layer_chunks`` finds them (per-layer graphs chain one layer's output into the next's input).
A container that speaks the protocol itself (``TransformerBlock``) can be graphed whole, its layers in one graph
(``cuda_graph_scope="block"``).

Everything else the graphs need (buffers to restore after the capture's warm-up, parameters,
forward pre-hooks) is read from the pieces' ``modules`` through ``nn.Module``'s public API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Hashable, List, Optional, Protocol, Sequence, Tuple, \
    runtime_checkable

import torch
from torch import nn

Outputs = Tuple[torch.Tensor, ...]
Finish = Callable[[Tuple[Any, ...], Outputs, Any], Any]

PROTOCOL_METHODS = ("graph_pieces", "set_graphed", "graph_constants")


def route_call(calls: Dict[str, Callable[..., Any]], allowed: Sequence[str], owner: str, entry: str,
               fn: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
    """``set_graphed`` as the protocol's layers implement it: ``calls[entry] = fn`` (``fn=None``: the call is
    eager again), refusing an ``entry`` not in ``allowed``; returns the callable it replaces."""
    if entry not in allowed:
        raise ValueError(f"{owner}.set_graphed: {entry!r} is not one of {tuple(allowed)}.")
    previous = calls.pop(entry, None)
    if fn is not None:
        calls[entry] = fn
    return previous


def first_output(args: Tuple[Any, ...], outputs: Outputs, aux: Any) -> torch.Tensor:
    """The default ``finish``: the call's result is the graph's (first) output."""
    return outputs[0]


@dataclass
class GraphPiece:
    """One graphable part of a layer, as the layer describes it.

    - ``entry``: the layer call the graph serves (the ``set_graphed`` key).
    - ``fn(*args)``: what is captured; returns a tensor, a tuple of tensors, or ``(tuple, aux)``
      where ``aux`` is host state the eager ``finish`` needs (kept from the capture).
    - ``eager(*args)``: the call's own body, run whenever no graph replays (warm-up, evaluation,
      ``no_grad``, a step that differs from the capture).
    - ``modules``: what ``fn`` runs: their parameters' gradients leave the backward graph and their
      submodules' forward pre-hooks are called by hand at replay (the layer's own run in its call).
    - ``arg_names``: the call's graphed arguments in order (keywords are bound to them); ``None``:
      positional tensors only. The graphs are captured for these arguments and nothing else.
    - ``name``: appended to ``"layer {index}"`` in messages and ``stats()``.
    - ``owner``: what messages and ``stats()`` call the graphed module instead of ``"layer {index}"`` (a
      container graphed whole says ``"block"``).
    - ``finish(args, outputs, aux)``: eager code turning the graph's outputs into the call's result.
    - ``segments``: the ``(first, last)`` half of the layer the piece covers, 0 = attention side,
      1 = MLP side; a piece starting right after the previous one ended can take its output without a copy.
    - ``ends_cleanly``: False when the graph stops inside its last segment (the eager ``finish``
      completes it), so the next piece cannot be chained to it.
    - ``sequence_parallel``: the layer runs under the RNG tracker's fork (sequence-parallel
      dropout), so its graphs are captured there too.
    - ``recomputed``: the layer is re-run in backward (activation checkpointing), which a captured
      graph cannot do: the graphs refuse it.
    """

    entry: str
    fn: Callable[..., Any]
    eager: Callable[..., Any]
    modules: Sequence[nn.Module]
    arg_names: Optional[Tuple[str, ...]] = None
    name: str = ""
    finish: Finish = first_output
    segments: Tuple[int, int] = (0, 1)
    ends_cleanly: bool = True
    sequence_parallel: bool = False
    recomputed: bool = False
    owner: Optional[str] = None

    def __post_init__(self) -> None:
        first, last = self.segments
        if not 0 <= first <= last <= 1:
            raise ValueError(f"GraphPiece {self.name or self.entry!r}: segments={self.segments}; use (0, 0) "
                             f"(attention side), (1, 1) (MLP side) or (0, 1) (the whole layer).")


@runtime_checkable
class GraphableLayer(Protocol):
    """A layer ``PartialCudaGraphs`` can graph (see the module docstring)."""

    def graph_pieces(self, scope: FrozenSet[str]) -> List[GraphPiece]: ...

    def set_graphed(self, entry: str, fn: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]: ...

    def graph_constants(self) -> Dict[str, Hashable]: ...


def missing_methods(layer: Any) -> List[str]:
    """The protocol methods ``layer`` lacks (empty: it is graphable)."""
    return [name for name in PROTOCOL_METHODS if not callable(getattr(layer, name, None))]
