"""What a layer's graphs hold (``cuda_graph_scope``), as entry points the partial graphs take over.

An *entry* is a method of the layer (``forward``, ``attention_block`` or ``mlp_block``) whose
body becomes one graphed :class:`Piece`, plus ``finish``: the eager code that turns the graph's
outputs into the method's result. Scopes (seed 003):

- ``"layer"``: the whole layer in one graph (any ``nn.Module`` whose forward takes tensors).
- ``"attn"``: ``TransformerLayer.attention_block`` (norm, attention, dropout, residual).
- ``"mlp"``: ``TransformerLayer.mlp_block`` (dense MLP; an MoE MLP only where it never syncs).
- ``"moe_router"`` / ``"moe_preprocess"`` (MoE layers, pre-norm): the graph stops after the
  router (``probs``, ``routing_map``; with ECHO spare slots also the offloading plan, which is
  sync-free) or after the dispatcher's ``preprocess`` (permuted tokens
  and ``dispatcher.meta``'s tensors), including the attention block when ``"attn"`` is in the
  scope; ``finish`` restores the dispatch metadata (host integers from the capture, tensors from
  the replay) and runs dispatch, experts and combine eagerly -- the parts whose shapes depend on
  the routing. Python exceptions are not needed to stop the capture: the MoE phases are methods.
  Dense layers of an MoE model follow ``"attn"``/``"mlp"``.

Segments number the sub-blocks of a chunk (attention of layer ``i`` = ``2i``, MLP = ``2i+1``):
an entry that starts right where the previous one ended *cleanly* is chained (its input is the
previous graph's output, no copy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .runner import Outputs, Piece

SCOPES = ("layer", "attn", "mlp", "moe_router", "moe_preprocess")
Finish = Callable[[Tuple[Any, ...], Outputs, Any], Any]


@dataclass
class Entry:
    """One method of one layer taken over by a graph."""

    layer: nn.Module
    method: str
    arg_names: Optional[Tuple[str, ...]]      # None: positional tensors, no keywords (generic modules)
    piece: Piece
    finish: Finish
    first_segment: int
    last_segment: int
    ends_cleanly: bool                        # False: the graph stops inside its last segment (MoE)
    chained: bool = False

    def eager(self, *args: Any) -> Any:
        return getattr(type(self.layer), self.method)(self.layer, *args)


def normalize_scope(scope: Union[None, str, Iterable[str]]) -> FrozenSet[str]:
    if scope is None:
        return frozenset({"layer"})
    names = frozenset({scope} if isinstance(scope, str) else scope)
    unknown = sorted(names - set(SCOPES))
    if unknown or not names:
        raise ValueError(f"cuda_graph_scope={scope!r}: {unknown or 'empty'} not in {list(SCOPES)}; use 'layer' "
                         f"(whole layers) or a list of 'attn', 'mlp', 'moe_router', 'moe_preprocess'.")
    if "layer" in names and len(names) > 1:
        raise ValueError(f"cuda_graph_scope={sorted(names)}: 'layer' already holds the whole layer; "
                         f"use 'layer' alone or a list of the parts.")
    return names


def _first(outputs: Outputs) -> torch.Tensor:
    return outputs[0]


def layer_entries(layer: nn.Module, index: int, scope: FrozenSet[str]) -> List[Entry]:
    """The entries of ``layer`` (the ``index``-th of its chunk) under ``scope``; may be empty."""
    from ..transformer.layer import TransformerLayer

    first = 2 * index
    if not isinstance(layer, TransformerLayer):
        if scope != {"layer"}:
            raise ValueError(f"cuda_graph_scope={sorted(scope)} needs TransformerLayer layers; "
                             f"{type(layer).__name__} can only be graphed whole (cuda_graph_scope='layer').")
        fn = lambda *args: (type(layer).forward(layer, *args),)
        piece = _piece(f"layer {index} ({type(layer).__name__})", fn, layer, include_self_hooks=False)
        return [Entry(layer, "forward", None, piece, lambda a, o, x: o[0], first, first + 1, True)]
    name = f"layer {index}"
    moe = _is_moe(layer)
    moe_stop = "preprocess" if "moe_preprocess" in scope else "route" if "moe_router" in scope else None
    if scope == {"layer"}:
        fn = lambda hidden, mask=None: (TransformerLayer.forward(layer, hidden, mask),)
        return [Entry(layer, "forward", ("hidden", "attention_mask"),
                      _piece(name, fn, layer, include_self_hooks=False), lambda a, o, x: o[0], first, first + 1, True)]
    if moe and moe_stop is not None:
        if not layer.pre_norm:
            raise ValueError(f"cuda_graph_scope {sorted(scope)} on {name}: MoE partial capture needs "
                             f"layernorm_order='pre' (the router reads the normalized residual stream).")
        with_attention = "attn" in scope
        fn, finish = _moe_head(layer, with_attention, moe_stop)
        modules = [layer.attention_norm, layer.attention, layer.mlp_norm, layer.mlp.router] if with_attention \
            else [layer.mlp_norm, layer.mlp.router]
        if layer.mlp.shared_experts is not None:
            modules.append(layer.mlp.shared_experts)
        piece = _piece(f"{name} {'attn+' if with_attention else ''}moe_{moe_stop}", fn, layer, modules)
        if with_attention:
            return [Entry(layer, "forward", ("hidden", "attention_mask"), piece, finish, first, first + 1, False)]
        return [Entry(layer, "mlp_block", ("hidden",), piece, finish, first + 1, first + 1, False)]
    entries = []
    if "attn" in scope:
        fn = lambda hidden, mask=None: (TransformerLayer.attention_block(layer, hidden, mask),)
        entries.append(Entry(layer, "attention_block", ("hidden", "attention_mask"),
                             _piece(f"{name} attn", fn, layer, [layer.attention_norm, layer.attention]),
                             lambda a, o, x: o[0], first, first, True))
    if "mlp" in scope:
        fn = lambda hidden: (TransformerLayer.mlp_block(layer, hidden),)
        entries.append(Entry(layer, "mlp_block", ("hidden",),
                             _piece(f"{name} mlp", fn, layer, [layer.mlp_norm, layer.mlp]),
                             lambda a, o, x: o[0], first + 1, first + 1, True))
    return entries


def _is_moe(layer: nn.Module) -> bool:
    from ..moe.layer import MoELayer

    return isinstance(getattr(layer, "mlp", None), MoELayer)


def _piece(name: str, fn: Callable[..., Any], layer: nn.Module, modules: Optional[Sequence[nn.Module]] = None,
           include_self_hooks: bool = True) -> Piece:
    """A piece over ``modules`` (default: the whole layer); ``fn`` returns outputs, or (outputs, aux)."""
    modules = list(modules) if modules is not None else [layer]
    params: List[nn.Parameter] = []
    seen = set()
    hook_modules: List[nn.Module] = []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for sub in module.modules():
            if sub is layer and not include_self_hooks:
                continue
            if sub._forward_pre_hooks and sub not in hook_modules:
                hook_modules.append(sub)

    def with_aux(*args: Any) -> Tuple[Outputs, Any]:
        result = fn(*args)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple):
            return result
        return tuple(result), None

    return Piece(name, with_aux, params, hook_modules)


@dataclass(frozen=True)
class _MoEAux:
    """What the eager rest of an MoE layer needs from the capture."""

    names: Tuple[str, ...]               # the graph's outputs, by role
    local_shape: Tuple[int, ...]         # this rank's tokens before flattening
    meta: Any = None                     # DispatchMetadata without its tensors (host integers)
    meta_names: Tuple[str, ...] = ()     # the tensor fields, in output order


def _moe_head(layer: nn.Module, with_attention: bool, stop: str) -> Tuple[Callable[..., Any], Finish]:
    from ..transformer.layer import TransformerLayer

    moe = layer.mlp
    hidden_size = moe.config.hidden_size

    def head(hidden: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Tuple[Outputs, _MoEAux]:
        h1 = TransformerLayer.attention_block(layer, hidden, mask) if with_attention else hidden
        x = layer.mlp_norm(h1)
        shared = moe.shared_experts_compute(x)
        local = moe._split_tokens(x)
        probs, routing_map, spare_homes = moe.offload(*moe.route(local))
        named: List[Tuple[str, torch.Tensor]] = [("h1", h1)] if with_attention else []
        meta, meta_names = None, ()
        if stop == "route":
            named += [("local", local), ("probs", probs), ("routing_map", routing_map)]
            if spare_homes is not None:
                named.append(("spare_homes", spare_homes))
        else:
            tokens, row_probs = moe.preprocess(local.reshape(-1, hidden_size), probs, routing_map, spare_homes)
            tensors = moe.dispatcher.meta.tensors()
            meta_names = tuple(tensors)
            meta = dataclasses.replace(moe.dispatcher.meta, **{n: None for n in meta_names})
            named += [("tokens", tokens), ("row_probs", row_probs)] + [(f"meta.{n}", t) for n, t in tensors.items()]
        if shared is not None:
            named.append(("shared", shared))
        aux = _MoEAux(tuple(n for n, _ in named), tuple(local.shape), meta, meta_names)
        return tuple(t for _, t in named), aux

    def finish(args: Tuple[Any, ...], outputs: Outputs, aux: _MoEAux) -> torch.Tensor:
        out = dict(zip(aux.names, outputs))
        h1 = out["h1"] if with_attention else args[0]
        if stop == "route":
            tokens, row_probs = moe.preprocess(out["local"].reshape(-1, hidden_size), out["probs"], out["routing_map"],
                                               out.get("spare_homes"))
        else:
            meta = dataclasses.replace(aux.meta)
            meta.load_tensors({n: out[f"meta.{n}"] for n in aux.meta_names})
            moe.dispatcher.meta = meta
            tokens, row_probs = out["tokens"], out["row_probs"]
        tokens, tokens_per_expert = moe.dispatch(tokens, row_probs)
        y = moe.combine(moe.experts_compute(tokens, tokens_per_expert)).view(aux.local_shape)
        y = moe._unsplit_tokens(y)
        if "shared" in out:
            y = y + out["shared"]
        return h1 + layer.dropout(y)

    return head, finish
