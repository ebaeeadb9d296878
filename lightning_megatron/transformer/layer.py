"""One transformer layer: attention and MLP sub-blocks with residuals; norms before, after or around each."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Hashable, List, Optional, Tuple, Union

import torch
from torch import nn

from ..tensor_parallel import init_method_normal
from .attention import SelfAttention
from .config import TransformerConfig
from .documents import DocumentMask
from .graphable import GraphPiece, route_call
from .mlp import MLP
from .norm import build_norm

if TYPE_CHECKING:
    from ..moe.layer import MoELayer


def build_mlp(config: TransformerConfig, layer_number: int) -> nn.Module:
    """The dense MLP, or an MoE layer on the layers ``config.moe_layer_freq`` selects."""
    if not config.is_moe_layer(layer_number):
        return MLP(config)
    from ..moe import MoELayer   # the dense model does not need the MoE machinery

    assert config.moe is not None   # is_moe_layer
    moe = dataclasses.replace(config.moe, sequence_parallel=config.sequence_parallel)
    return MoELayer(moe, init_method=init_method_normal(config.init_method_std),
                    output_layer_init_method=init_method_normal(config.output_layer_init_std),
                    params_dtype=config.params_dtype)


def given(**inputs: Any) -> Dict[str, Any]:
    """The optional per-layer inputs that are not None, as keywords."""
    return {name: value for name, value in inputs.items() if value is not None}


class TransformerLayer(nn.Module):
    """``layernorm_order`` (``f`` is attention, then the MLP, each with its own norms):
    ``pre``: ``x + drop(f(norm(x)))`` (seed 002, Fig. 7b); ``post`` (original BERT): ``norm(x + drop(f(x)))``;
    ``sandwich`` (Gemma 2/3): ``x + drop(out_norm(f(norm(x))))``; ``post_sublayer`` (OLMo-2):
    ``x + drop(out_norm(f(x)))``. The norms on a sub-block's output are ``attention_output_norm`` and
    ``mlp_output_norm``; ``attention_norm`` and ``mlp_norm`` are the others (``nn.Identity`` under ``post_sublayer``).

    ``mlp`` replaces the dense MLP (e.g. an MoE layer); it may return ``(output, extra)``.

    Graphable (``graphable.py``): ``forward``, ``attention_block`` and ``mlp_block`` go to the callable
    ``set_graphed`` gave them, if any (per-layer CUDA graphs).
    """

    GRAPHED_CALLS = ("forward", "attention_block", "mlp_block")
    # overlap_param_gather waits for the whole layer's parameters before its forward, not inside its
    # (compiled, graphed) bodies: distributed/param_buffer.py
    wait_for_params_as_one = True

    def __init__(self, config: TransformerConfig, layer_number: int, mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.order = config.layernorm_order
        self.layer_number = layer_number
        inputs_normed = self.order != "post_sublayer"
        outputs_normed = self.order in ("sandwich", "post_sublayer")
        self.attention_norm = build_norm(config) if inputs_normed else nn.Identity()
        self.attention = SelfAttention(config, layer_number)
        self.attention_output_norm = build_norm(config) if outputs_normed else nn.Identity()
        self.mlp_norm = build_norm(config) if inputs_normed else nn.Identity()
        self.mlp = mlp if mlp is not None else build_mlp(config, layer_number)
        self.mlp_output_norm = build_norm(config) if outputs_normed else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.graphed_calls: Dict[str, Callable[..., Any]] = {}   # set_graphed: call name -> graph replay

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out[0] if isinstance(out, tuple) else out

    # Each public call goes to its graph when one is set; (hidden, mask) plus only the inputs given, by
    # name: a graph takes (hidden, mask) and refuses the others by their names.
    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                document_ids: Union[torch.Tensor, DocumentMask, None] = None) -> torch.Tensor:
        extra = given(position_ids=position_ids, document_ids=document_ids)
        graphed = self.graphed_calls.get("forward")
        if graphed is not None:
            return graphed(hidden, attention_mask, **extra)
        return self._forward(hidden, attention_mask, **extra)

    # The two sub-blocks are methods of their own so a per-layer CUDA graph can hold either one
    # (``cuda_graph_scope`` "attn" / "mlp", see ``lightning_megatron.cuda_graphs``).
    def attention_block(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                        position_ids: Optional[torch.Tensor] = None,
                        document_ids: Union[torch.Tensor, DocumentMask, None] = None) -> torch.Tensor:
        """``position_ids``: only for rotary embeddings, when not the tokens' global positions;
        ``document_ids``: packed documents, which attention does not cross."""
        extra = given(position_ids=position_ids, document_ids=document_ids)
        graphed = self.graphed_calls.get("attention_block")
        if graphed is not None:
            return graphed(hidden, attention_mask, **extra)
        return self._attention_block(hidden, attention_mask, **extra)

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        graphed = self.graphed_calls.get("mlp_block")
        return graphed(hidden) if graphed is not None else self._mlp_block(hidden)

    # -- the eager bodies ---------------------------------------------------------------------------
    def _forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 **extra: Any) -> torch.Tensor:
        return self.mlp_block(self.attention_block(hidden, attention_mask, **extra))

    def _attention_block(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                         position_ids: Optional[torch.Tensor] = None,
                         document_ids: Union[torch.Tensor, DocumentMask, None] = None) -> torch.Tensor:
        inputs = (attention_mask, position_ids, document_ids)
        if self.order == "post":
            return self.attention_norm(hidden + self.dropout(self.attention(hidden, *inputs)))
        out = self.attention_output_norm(self.attention(self.attention_norm(hidden), *inputs))
        return hidden + self.dropout(out)

    def _mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.order == "post":
            return self.mlp_norm(hidden + self.dropout(self._mlp(hidden)))
        return hidden + self.dropout(self.mlp_output_norm(self._mlp(self.mlp_norm(hidden))))

    # -- the graphable-layer protocol (graphable.py) ---------------------------------------------------
    def set_graphed(self, entry: str, fn: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
        """Route the call ``entry`` to ``fn`` (None: eager again); returns what it replaces."""
        return route_call(self.graphed_calls, self.GRAPHED_CALLS, "TransformerLayer", entry, fn)

    def graph_constants(self) -> Dict[str, Hashable]:
        """The MoE routers' balancing-loss scale: baked into a graph's backward at capture."""
        from ..moe.router import TopKRouter

        return {f"{name}.aux_loss_scale": (m.aux_loss_scale, m.aux_loss_per_token)
                for name, m in self.named_modules() if isinstance(m, TopKRouter)}

    def graph_pieces(self, scope: FrozenSet[str]) -> List[GraphPiece]:
        """What ``cuda_graph_scope`` captures of this layer (see ``cuda_graphs/scopes.py``)."""
        config = self.attention.config    # the block's: it forks the RNG and recomputes by this config
        static: Dict[str, Any] = dict(arg_names=("hidden", "attention_mask"),
                                      sequence_parallel=config.sequence_parallel, recomputed=config.recompute_layers)
        if scope == {"layer"}:
            return [GraphPiece("forward", self._forward, self._forward, [self], **static)]
        if "block" in scope:
            raise ValueError("cuda_graph_scope='block' graphs the container of a chunk's layers (TransformerBlock), "
                             "not a layer: pass layer_chunks(model, scope='block') to PartialCudaGraphs.")
        moe_stop = "preprocess" if "moe_preprocess" in scope else "route" if "moe_router" in scope else None
        if moe_stop is not None and self._moe() is not None:
            return [self._moe_piece(scope, moe_stop, static)]
        pieces = []
        if "attn" in scope:
            pieces.append(GraphPiece("attention_block", self._attention_block, self._attention_block,
                                     [self.attention_norm, self.attention, self.attention_output_norm], name="attn",
                                     segments=(0, 0), **static))
        if "mlp" in scope:
            pieces.append(GraphPiece("mlp_block", self._mlp_block, self._mlp_block,
                                     [self.mlp_norm, self.mlp, self.mlp_output_norm],
                                     name="mlp", segments=(1, 1), **{**static, "arg_names": ("hidden",)}))
        return pieces

    def _moe(self) -> Optional[MoELayer]:
        from ..moe.layer import MoELayer

        return self.mlp if isinstance(self.mlp, MoELayer) else None

    def _moe_piece(self, scope: FrozenSet[str], stop: str, static: Dict[str, Any]) -> GraphPiece:
        """The graph stops inside the MoE MLP, after ``stop`` (``MoELayer.forward_head``); ``finish`` runs
        ``forward_tail`` eagerly. With ``"attn"`` in the scope the attention block is in the same graph."""
        if self.order != "pre":
            raise ValueError(f"cuda_graph_scope {sorted(scope)} on MoE layer {self.layer_number}: MoE partial "
                             f"capture needs layernorm_order='pre' (the router reads the normalized residual stream "
                             f"and the expert output joins it unnormalised), not {self.order!r}.")
        moe = self._moe()
        assert moe is not None   # graph_pieces asks only MoE layers
        with_attention = "attn" in scope

        def head(hidden: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Tuple[Tuple[torch.Tensor, ...], Any]:
            h1 = self._attention_block(hidden, mask) if with_attention else hidden
            outputs, state = moe.forward_head(self.mlp_norm(h1), stop)
            return ((h1,) + outputs if with_attention else outputs), state

        def finish(args: Tuple[Any, ...], outputs: Tuple[torch.Tensor, ...], state: Any) -> torch.Tensor:
            h1, rest = (outputs[0], outputs[1:]) if with_attention else (args[0], outputs)
            return h1 + self.dropout(moe.forward_tail(rest, state))

        modules = [self.attention_norm, self.attention, self.attention_output_norm] if with_attention else []
        modules += [self.mlp_norm] + moe.head_modules()
        name = f"{'attn+' if with_attention else ''}moe_{stop}"
        if with_attention:
            return GraphPiece("forward", head, self._forward, modules, name=name, finish=finish, ends_cleanly=False,
                              **static)
        return GraphPiece("mlp_block", head, self._mlp_block, modules, name=name, finish=finish, segments=(1, 1),
                          ends_cleanly=False, **{**static, "arg_names": ("hidden",)})
