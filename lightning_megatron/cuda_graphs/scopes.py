"""What a layer's graphs hold (``cuda_graph_scope``), as entries the partial graphs take over.

The layer says what it can graph (``transformer/graphable.py``): each :class:`GraphPiece` becomes an *entry*,
one call of the layer (``forward``, ``attention_block``, ...) whose body is one graphed
:class:`Piece`, plus ``finish``: the eager code that turns the graph's outputs into the call's result.
Scopes (seed 003), as ``TransformerLayer`` implements them:

- ``"layer"``: the whole layer in one graph.
- ``"block"``: a chunk's layers together in one graph: the container (``TransformerBlock``) is the one graphable
  "layer" of its chunk (``layer_chunks(model, scope="block")``). One replay and one autograd node a micro-batch
  instead of one a layer: for models whose per-layer replays are host-bound (BERT-base: ~0.1 ms of host work a
  layer and direction); nothing can run between its layers (no eager MoE tail).
- ``"attn"``: ``attention_block`` (norm, attention, dropout, residual).
- ``"mlp"``: ``mlp_block`` (dense MLP; an MoE MLP only where it never syncs).
- ``"moe_router"`` / ``"moe_preprocess"`` (MoE layers, pre-norm): the graph stops after the
  router (``probs``, ``routing_map``; with ECHO spare slots also the offloading plan, which is
  sync-free) or after the dispatcher's ``preprocess`` (permuted tokens and ``dispatcher.meta``'s
  tensors), including the attention block when ``"attn"`` is in the scope; ``finish`` runs
  dispatch, experts and combine eagerly -- the parts whose shapes depend on the routing
  (``MoELayer.forward_head`` / ``forward_tail``). Dense layers of an MoE model follow ``"attn"``/``"mlp"``.

Segments number the sub-blocks of a chunk (attention of layer ``i`` = ``2i``, MLP = ``2i+1``):
an entry that starts right where the previous one ended *cleanly* is chained (its input is the
previous graph's output, no copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from ..transformer.graphable import Finish, GraphableLayer, missing_methods
from .errors import CudaGraphError
from .runner import Outputs, Piece

SCOPES = ("layer", "block", "attn", "mlp", "moe_router", "moe_preprocess")
WHOLE_SCOPES = ("layer", "block")   # scopes that stand alone


@dataclass
class Entry:
    """One method of one layer taken over by a graph."""

    layer: nn.Module
    method: str
    arg_names: Optional[Tuple[str, ...]]      # None: positional tensors, no keywords
    piece: Piece
    finish: Finish
    eager: Callable[..., Any]                 # the call's own body (no graph)
    first_segment: int
    last_segment: int
    ends_cleanly: bool                        # False: the graph stops inside its last segment (MoE)
    sequence_parallel: bool
    chained: bool = False

    @property
    def graphable(self) -> GraphableLayer:
        """``layer`` through the graphable-layer protocol (``layer_entries`` checked that it has the methods)."""
        return cast(GraphableLayer, self.layer)


def normalize_scope(scope: Union[None, str, Iterable[str]]) -> FrozenSet[str]:
    if scope is None:
        return frozenset({"layer"})
    names = frozenset({scope} if isinstance(scope, str) else scope)
    unknown = sorted(names - set(SCOPES))
    if unknown or not names:
        raise ValueError(f"cuda_graph_scope={scope!r}: {unknown or 'empty'} not in {list(SCOPES)}; use 'layer' "
                         f"(whole layers), 'block' (a chunk's layers in one graph) or a list of 'attn', 'mlp', "
                         f"'moe_router', 'moe_preprocess'.")
    for whole in WHOLE_SCOPES:
        if whole in names and len(names) > 1:
            raise ValueError(f"cuda_graph_scope={sorted(names)}: {whole!r} already holds whole layers; "
                             f"use {whole!r} alone or a list of the parts.")
    return names


def layer_entries(layer: nn.Module, index: int, scope: FrozenSet[str]) -> List[Entry]:
    """The entries of ``layer`` (the ``index``-th of its chunk) under ``scope``; may be empty."""
    missing = missing_methods(layer)
    if missing:
        raise CudaGraphError(
            f"layer {index} ({type(layer).__name__}) cannot be graphed: it lacks {', '.join(missing)} of the "
            f"graphable-layer protocol (lightning_megatron.cuda_graphs.GraphableLayer): graph_pieces(scope) says "
            f"what to capture, set_graphed(entry, fn) routes the layer's call to the graph, graph_constants() "
            f"names host values baked into it. Implement them, or use cuda_graph=None.")
    entries = []
    for piece in cast(GraphableLayer, layer).graph_pieces(scope):
        if piece.recomputed:
            raise CudaGraphError("recompute_layers=True re-runs layers in backward, which a captured graph cannot "
                                 "do; set TransformerConfig(recompute_layers=False) with partial CUDA graphs (the "
                                 "graphs' shared pool already bounds activation memory by the micro-batches in "
                                 "flight).")
        label = piece.owner or f"layer {index}"
        name = f"{label} {piece.name}" if piece.name else label
        first, last = piece.segments
        entries.append(Entry(layer, piece.entry, piece.arg_names, _piece(name, piece.fn, layer, piece.modules),
                             piece.finish, piece.eager, 2 * index + first, 2 * index + last, piece.ends_cleanly,
                             piece.sequence_parallel))
    return entries


def _piece(name: str, fn: Callable[..., Any], layer: nn.Module, modules: Sequence[nn.Module]) -> Piece:
    """A piece over ``modules``; ``fn`` returns a tensor, a tuple of them, or (outputs, aux).

    The layer's own forward pre-hooks are left out: its call (which reaches the graph) runs them.
    """
    params: List[nn.Parameter] = []
    seen = set()
    hook_modules: List[nn.Module] = []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for sub in module.modules():
            if sub is layer:
                continue
            if sub._forward_pre_hooks and sub not in hook_modules:
                hook_modules.append(sub)

    def with_aux(*args: Any) -> Tuple[Outputs, Any]:
        result = fn(*args)
        if isinstance(result, torch.Tensor):
            return (result,), None
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple):
            return result
        return tuple(result), None

    return Piece(name, with_aux, params, hook_modules)
