"""The transformer layers of one pipeline stage / virtual chunk, and the final norm on the last."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, FrozenSet, Hashable, List, Optional, Sequence

import torch
from torch import nn

from ..parallel import chunk_position, get_parallel_state
from ..tensor_parallel import checkpoint, get_rng_tracker
from .config import TransformerConfig, with_strategy_defaults
from .documents import DocumentMask
from .graphable import GraphPiece, route_call
from .layer import TransformerLayer, given
from .norm import build_norm
from .stage_layers import build_stage_layers


class TransformerBlock(nn.Module):
    """Layers ``chunk_layer_range(...)`` of the model (seed 000's offsets), built on this rank only.

    Works on ``[s, b, h]``; under sequence parallelism ``s`` is this rank's slice and the whole
    block draws dropout from the tp-rank generator, since each rank holds different tokens.
    """

    def __init__(self, config: TransformerConfig, vp_rank: int = 0,
                 layer_factory: Optional[Callable[[int], nn.Module]] = None,
                 first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                 pipeline_layout: Optional[Sequence[int]] = None) -> None:
        super().__init__()
        config = with_strategy_defaults(config)
        config.check_tensor_parallel(get_parallel_state().tp_size)   # before any layer: the user's names
        self.config = config
        build = layer_factory or (lambda index: TransformerLayer(config, index + 1))
        self.layers, self.layer_indices = build_stage_layers(
            config.num_layers, build, config.init_seed, vp_rank, first_stage_layers, last_stage_layers,
            pipeline_layout)
        _, is_last = chunk_position(vp_rank)
        self.final_norm = build_norm(config) if config.layernorm_order != "post" and is_last else None
        self.graphed_calls: Dict[str, Callable[..., Any]] = {}   # set_graphed: cuda_graph_scope="block"

    def graphable_layers(self) -> nn.ModuleList:
        """This chunk's layers, run one after another (per-layer CUDA graphs chain them)."""
        return self.layers

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``position_ids [b, s]`` (rotary embeddings only): positions other than the tokens' global ones.
        ``document_ids [b, s]``: packed documents (0, 1, ... per row, -1 on padding), which attention does
        not cross; their masks are built once here for all layers (``DocumentMask``)."""
        rng = (get_rng_tracker().fork() if self.config.sequence_parallel and self.training
               else contextlib.nullcontext())
        documents = None if document_ids is None else DocumentMask.of(document_ids)
        # layers are called as (hidden, mask) plus only the inputs given, by name: per-layer CUDA graphs wrap
        # the (hidden, mask) call and refuse the others by name
        extra = given(position_ids=position_ids, document_ids=documents)
        graphed = self.graphed_calls.get("forward")
        with rng:
            hidden = graphed(hidden, attention_mask, **extra) if graphed is not None else \
                self._layers(hidden, attention_mask, **extra)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return hidden

    def _layers(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **extra: Any) -> torch.Tensor:
        for layer in self.layers:
            if self.config.recompute_layers and self.training:
                hidden = checkpoint(layer, hidden, attention_mask, **extra)
            else:
                hidden = layer(hidden, attention_mask, **extra)
        return hidden

    # -- the graphable-layer protocol (graphable.py), for cuda_graph_scope="block" --------------------------
    def graph_pieces(self, scope: FrozenSet[str]) -> List[GraphPiece]:
        """The chunk's layers in one graph (the final norm stays eager); nothing under the other scopes,
        which graph the layers themselves."""
        if scope != {"block"} or not len(self.layers):   # an empty chunk (uneven layouts) has nothing to graph
            return []
        return [GraphPiece("forward", self._layers, self._layers, [self.layers], arg_names=("hidden", "attention_mask"),
                           sequence_parallel=self.config.sequence_parallel, recomputed=self.config.recompute_layers,
                           owner="block")]

    def set_graphed(self, entry: str, fn: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
        """Route the block's layers (``entry="forward"``) to ``fn`` (None: eager again); returns what it replaces."""
        return route_call(self.graphed_calls, ("forward",), "TransformerBlock", entry, fn)

    def graph_constants(self) -> Dict[str, Hashable]:
        """Every layer's constants (an MoE router's balancing-loss scale), by layer position."""
        return {f"{i}.{name}": value for i, layer in enumerate(self.layers)
                for name, value in getattr(layer, "graph_constants", dict)().items()}
