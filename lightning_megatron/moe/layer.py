"""``MoELayer``: router → token dispatch → grouped experts → combine, plus shared experts.

How tokens reach the expert ranks (MoE folding). The layer's input comes from the dense side,
laid out over the dense tp group: replicated (every tp rank holds the whole ``[S, B, H]``) or
sequence-parallel (each holds ``[S/tp, B, H]``). The experts live on the expert grid
(etp × ep × edp) of the same ranks, and may be placed quite differently (etp ≠ tp).

1. Every rank must route *distinct* tokens, or the experts would see a replicated token tp
   times and its gradient tp-fold. A replicated input is therefore first split along the
   sequence over tp (``scatter_to_sequence_parallel_region``: backward all-gathers the input
   gradient); a sequence-parallel input already is. After the combine the split is undone
   (``gather_from_sequence_parallel_region`` with a replicated consumer: backward keeps this
   rank's slice), so the output has the input's layout. The router weight is replicated but
   sees only this rank's tokens: it carries ``sequence_parallel=True`` (when tp > 1) so its
   gradient is summed over tp with the other sequence-parallel parameters.
2. Each rank's tokens only travel inside its expert model-parallel group (tp-ep = etp × ep
   ranks), which holds one complete copy of every expert: all-to-all over ep then all-gather
   over etp (``dispatcher="alltoall"``), or all-gather over tp-ep (``"allgather"``). The
   combine sends the (etp-summed) results back to the token's own rank. Every rank of the
   world is in exactly one tp-ep group, so no alignment between tp and tp-ep is needed.
3. Expert weights are replicated over edp: their gradients are summed over the edp group
   (parameters carry ``expert_parallel=True``), the router's and shared experts' over dp.
4. ECHO (``num_spare_experts_per_ep_rank=k``, seed 004): between routing and dispatch, ``offload``
   plans which tokens of overloaded EP ranks' experts go to spare slots on other ranks; the
   dispatcher then sees ``E + ep·k`` columns (per rank: ``E/ep`` home experts, then ``k`` slots),
   and ``experts_compute`` runs the slots with copies of their home experts' weights
   (``spare_weights``), whose gradients flow back to the home expert. In training steps after one whose routing
   needed no offloading the layer skips the plan and routes over its home experts alone (``echo_schedule``).

Balancing losses count tokens over the tp-cp group (see ``aux_loss``), so they equal the
single-rank values; ``set_aux_loss_scale`` keeps them invariant to the micro-batch count.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..tensor_parallel.layers import InitMethod, init_method_normal, init_sharded_
from ..tensor_parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from ..tensor_parallel.utils import divide
from .comm import all_gather_stack, group_rank, group_size
from .dispatcher import DISPATCHERS, DispatchMetadata, TokenDispatcher, build_dispatcher
from .echo import home_expert_of_spare, interleave_spare_slots, plan_token_moves, reroute_probs
from .echo_schedule import EchoSchedule
from .experts import ACTIVATIONS, GroupedMLP, SharedExpertMLP
from .graph_replay import GraphReplay
from .groups import MoEGroups
from .router import TopKRouter
from .spare_weights import weights_with_spare_slots


@dataclasses.dataclass
class MoEConfig:
    """Sizes and options of one MoE layer (names follow Megatron-Core's ``moe_*`` options)."""

    hidden_size: int
    ffn_hidden_size: int                       # per routed expert
    num_experts: int
    topk: int = 2
    dispatcher: str = "alltoall"               # "alltoall" | "allgather"
    activation: str = "swiglu"                 # "swiglu" | "gelu"
    shared_expert_ffn_hidden_size: Optional[int] = None
    shared_expert_gate: bool = False           # shared output times sigmoid(x·w), w: hidden -> 1 (Qwen2-MoE)
    sequence_parallel: bool = False
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    aux_loss_coeff: float = 0.0
    aux_loss_type: str = "per_layer"           # what aux_loss_coeff weighs: "per_layer" | "hf_pooled" (router.py)
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    enable_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    expert_backend: str = "auto"               # GroupedMLP backend: auto | grouped_mm | loop | bmm
    num_spare_experts_per_ep_rank: int = 0     # ECHO: k spare expert slots per EP rank (0: off)
    # ECHO offloads only an EP rank's load above (1 + echo_tolerance) x the mean; a micro-batch with every rank
    # within it moves no expert weights (known at the dispatch's host sync). Moving a slot's weights costs about
    # what a 1.5x imbalance costs at EP4 (benchmarks/RESULTS.md, ECHO at EP=4): small imbalances are cheaper kept.
    echo_tolerance: float = 0.25

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}.")
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ValueError("shared_expert_gate=True gates the shared experts: set shared_expert_ffn_hidden_size.")
        if self.num_spare_experts_per_ep_rank < 0:
            raise ValueError("num_spare_experts_per_ep_rank must be >= 0 (0 turns ECHO offloading off), "
                             f"got {self.num_spare_experts_per_ep_rank}.")
        if not self.echo_tolerance >= 0:
            raise ValueError(f"echo_tolerance must be >= 0 (the imbalance over the mean load ECHO leaves alone, e.g. "
                             f"0.25), got {self.echo_tolerance!r}.")
        if self.num_spare_experts_per_ep_rank and self.capacity_factor is not None:
            raise ValueError("num_spare_experts_per_ep_rank > 0 (ECHO offloading) needs dropless routing: "
                             f"set capacity_factor=None (got {self.capacity_factor}); offloading rebalances the "
                             "tokens a capacity would drop.")

    def router_kwargs(self) -> Dict[str, Any]:
        names = ("score_function", "pre_softmax", "num_groups", "group_topk", "scaling_factor", "aux_loss_coeff",
                 "seq_aux_loss_coeff", "z_loss_coeff", "aux_loss_type", "enable_expert_bias", "expert_bias_update_rate",
                 "capacity_factor", "drop_policy", "pad_to_capacity")
        return {name: getattr(self, name) for name in names}


def _integer_plan(routing_map: Tensor, counts: Tensor, *, source: int, num_ep_ranks: int,
                  k: int, tolerance: float) -> Tuple[Tensor, ...]:
    """ECHO's plan without the probabilities: ``(rank-major routing map, moved, moved_from_home,
    home_index, spare_homes)``; integers only, so it can be replayed from a CUDA graph."""
    plan = plan_token_moves(routing_map, counts, source, num_ep_ranks, k, tolerance)
    m = plan.moves
    return (interleave_spare_slots(m.routing_map, num_ep_ranks, k), m.moved, m.moved_from_home, m.home_index,
            home_expert_of_spare(plan.expert_offloading_map))


HEAD_STOPS = ("route", "preprocess")


@dataclasses.dataclass(frozen=True)
class HeadState:
    """What :meth:`MoELayer.forward_tail` needs from :meth:`MoELayer.forward_head` besides its tensors."""

    stop: str                            # "route" | "preprocess"
    names: Tuple[str, ...]               # the head's tensors, by role
    local_shape: Tuple[int, ...]         # this rank's tokens before flattening
    meta: Any = None                     # DispatchMetadata without its tensors (host integers)
    meta_names: Tuple[str, ...] = ()     # its tensor fields, in output order


class MoELayer(nn.Module):
    """A mixture-of-experts MLP block. ``forward(x)`` keeps ``x``'s shape and layout.

    ``x`` is ``[S, B, H]`` (sequence-first; ``[S/tp, B, H]`` under sequence parallelism) or
    ``[T, H]``. The phases are separate methods (``shared_experts_compute``, ``route``, ``offload``,
    ``preprocess``, ``dispatch``, ``experts_compute``, ``combine``) so a partial CUDA graph can stop after
    ``route`` (with ``offload``) or ``preprocess`` (``forward_head``; ``forward_tail`` runs the rest);
    ``self.dispatcher.meta`` holds the routing bookkeeping in between.
    ``self.aux_losses`` are the balancing losses of the last forward (this rank's parts).
    """

    def __init__(self, config: MoEConfig, *, groups: Optional[MoEGroups] = None,
                 init_method: Optional[InitMethod] = None, output_layer_init_method: Optional[InitMethod] = None,
                 params_dtype: torch.dtype = torch.float32,
                 device: Optional[Union[torch.device, str]] = None) -> None:
        super().__init__()
        self.config = config
        self._explicit_groups = groups
        g = self.groups
        self.tp_size = group_size(g.tp)
        self.sequence_parallel = config.sequence_parallel and self.tp_size > 1
        self.router = TopKRouter(config.hidden_size, config.num_experts, config.topk, init_method=init_method,
                                 params_dtype=params_dtype, device=device, loss_group=groups.tp_cp if groups else None,
                                 **config.router_kwargs())
        # Tokens are split over tp before routing, so the router's gradient is partial over tp.
        self.router.weight.sequence_parallel = self.tp_size > 1  # type: ignore[attr-defined]  # runtime attribute
        if config.shared_expert_ffn_hidden_size:
            self.shared_experts: Optional[SharedExpertMLP] = SharedExpertMLP(
                config.hidden_size, config.shared_expert_ffn_hidden_size, activation=config.activation,
                sequence_parallel=self.sequence_parallel, init_method=init_method,
                output_layer_init_method=output_layer_init_method, params_dtype=params_dtype, device=device,
                group=groups.tp if groups else None)   # None: follow the active state (keeps it copyable)
        else:
            self.shared_experts = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if config.shared_expert_gate:
            # replicated like the router (drawn as at TP=1); per token, so under sequence parallelism each tp rank's
            # gradient covers its own tokens only and is summed over tp with the other sequence-parallel weights
            gate = nn.Linear(config.hidden_size, 1, bias=False, device=device, dtype=params_dtype)
            init_sharded_(gate.weight, (1, config.hidden_size), 0, init_method or init_method_normal(), 0, 1)
            gate.weight.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
            self.shared_expert_gate = gate
        ep_size, ep_rank = group_size(g.ep), group_rank(g.ep)
        num_home = divide(config.num_experts, ep_size, "num_experts", by="expert-parallel size (ep)")
        # ECHO needs another EP rank to offload to; at ep=1 it would only add empty slots.
        self.num_spare = config.num_spare_experts_per_ep_rank if ep_size > 1 else 0
        self._plan = GraphReplay(_integer_plan)   # on GPUs the plan's ~80 small kernels replay as one graph
        # With spare slots the dispatcher of a planned routing sees E + ep*k rank-major columns: E/ep home + k spare
        # per rank; an unplanned one (echo_schedule.py) the E home columns, its loads watched.
        self._spare_dispatcher: Optional[TokenDispatcher] = build_dispatcher(
            config.dispatcher, config.num_experts + ep_size * self.num_spare, config.topk, groups) \
            if self.num_spare else None
        self._home_dispatcher = build_dispatcher(config.dispatcher, config.num_experts, config.topk, groups,
                                                 report_loads=bool(self.num_spare))
        #: the dispatcher of the routing in flight (``preprocess`` picks it by the routing map's width)
        self.dispatcher: TokenDispatcher = self._spare_dispatcher or self._home_dispatcher
        #: when ECHO plans (None without spare slots)
        self.echo: Optional[EchoSchedule] = EchoSchedule() if self.num_spare else None
        d = self.dispatcher
        self.experts = GroupedMLP(num_home, config.hidden_size, config.ffn_hidden_size,
                                  activation=config.activation, first_expert=ep_rank * num_home,
                                  etp_size=d.etp_size, etp_rank=d.etp_rank, init_method=init_method,
                                  output_layer_init_method=output_layer_init_method, params_dtype=params_dtype,
                                  device=device, backend=config.expert_backend)

    @property
    def groups(self) -> MoEGroups:
        return MoEGroups.resolve(self._explicit_groups)

    @property
    def aux_losses(self) -> Dict[str, Tensor]:
        return self.router.aux_losses

    # -- the phases ------------------------------------------------------------------------------
    def shared_experts_compute(self, x: Tensor) -> Optional[Tensor]:
        """The shared experts on the layer's input (dense layout), or None without them; with
        ``shared_expert_gate``, times ``sigmoid(x·w)`` per token (Qwen2-MoE)."""
        if self.shared_experts is None:
            return None
        out = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            out = out * torch.sigmoid(self.shared_expert_gate(x))
        return out

    def route(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``(probs [T, E], routing_map [T, E])`` for this rank's tokens."""
        return self.router(x)

    def offload(self, probs: Tensor, routing_map: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """ECHO: move tokens of overloaded EP ranks' experts to spare slots on underloaded ranks.

        Returns ``(probs, routing_map, spare_homes)``: with offloading on, the first two are
        ``[T, E + ep·k]`` in rank-major column order and ``spare_homes [ep·k]`` names the home expert
        each spare slot copies (``-1``: unused); otherwise the inputs and ``None``. The plan reads the
        token counts of every rank sending to these experts (etp × ep), so all of them agree on it.
        """
        if not self.num_spare:
            return probs, routing_map, None
        g, d = self.groups, self.dispatcher
        counts = all_gather_stack(all_gather_stack(routing_map.sum(dim=0), g.ep), g.etp)
        counts = counts.view(-1, self.config.num_experts)                   # [etp·ep, E], row q·ep + p
        routing_map, moved, moved_from_home, home_index, spare_homes = self._plan(
            routing_map, counts, source=d.etp_rank * d.ep_size + d.ep_rank, num_ep_ranks=d.ep_size, k=self.num_spare,
            tolerance=self.config.echo_tolerance)
        probs = reroute_probs(probs, moved, moved_from_home, home_index)
        return interleave_spare_slots(probs, d.ep_size, self.num_spare), routing_map, spare_homes

    def preprocess(self, tokens: Tensor, probs: Tensor, routing_map: Tensor,
                   spare_homes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Permute the tokens for dispatch: over the spare slots' columns if ``routing_map`` has them (``offload``'s,
        with its ``spare_homes``), else over the home experts."""
        if self._spare_dispatcher is not None:
            planned = routing_map.shape[-1] != self.config.num_experts
            if planned and spare_homes is None:
                raise RuntimeError("This MoELayer has ECHO spare slots: pass offload()'s spare_homes to preprocess().")
            self.dispatcher = self._spare_dispatcher if planned else self._home_dispatcher
        capacity = self.router.capacity(tokens.shape[0]) if self.config.pad_to_capacity else None
        out = self.dispatcher.preprocess(tokens, probs, routing_map, capacity=capacity, dropless=self.router.dropless)
        self.dispatcher.meta.spare_homes = spare_homes
        return out

    def dispatch(self, tokens: Tensor, probs: Tensor) -> Tuple[Tensor, Tensor]:
        out = self.dispatcher.dispatch(tokens, probs)
        if self.echo is not None:   # what the dispatch's host sync read: the schedule's observation
            meta = self.dispatcher.meta
            if self.dispatcher is self._spare_dispatcher:
                self.echo.saw_plan(meta.spare_slots_used)
            else:
                self.echo.saw_loads(meta.rows_per_ep_rank, self.config.echo_tolerance)
        return out

    def experts_compute(self, tokens: Tensor, tokens_per_expert: Tensor) -> Tensor:
        meta = self.dispatcher.meta
        if self.dispatcher is not self._spare_dispatcher:   # no ECHO, or a routing over the home experts alone
            return self.experts(tokens, tokens_per_expert, meta.rows_per_expert)
        assert meta.spare_homes is not None   # preprocess requires them with the spare columns
        if meta.spare_slots_used is False:   # read at the dispatch's host sync: no slot has rows, no weights move
            return self.experts(tokens, tokens_per_expert[:self.experts.num_local_experts], meta.rows_per_expert)
        weights = weights_with_spare_slots((self.experts.weight1, self.experts.weight2), meta.spare_homes,
                                           self.groups.ep, self.num_spare, homes_on_host=meta.spare_homes_host)
        return self.experts(tokens, tokens_per_expert, meta.rows_per_expert, weights=weights)

    def combine(self, expert_output: Tensor) -> Tensor:
        return self.dispatcher.combine(expert_output)

    # -- the whole layer -------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"MoELayer expects hidden size {self.config.hidden_size}, got input {tuple(x.shape)}.")
        shared = self.shared_experts_compute(x)
        local = self.split_tokens(x)
        probs, routing_map = self.route(local)
        spare_homes = None
        if self.echo is None or self.echo.plans:
            probs, routing_map, spare_homes = self.offload(probs, routing_map)
        tokens, probs = self.preprocess(local.reshape(-1, self.config.hidden_size), probs, routing_map, spare_homes)
        tokens, tokens_per_expert = self.dispatch(tokens, probs)
        out = self.combine(self.experts_compute(tokens, tokens_per_expert)).view(local.shape)
        out = self.unsplit_tokens(out)
        return out if shared is None else out + shared

    # -- forward in two parts, for partial CUDA graphs --------------------------------------------
    def forward_head(self, x: Tensor, stop: str) -> Tuple[Tuple[Tensor, ...], "HeadState"]:
        """``forward`` up to ``stop`` -- ``"route"`` (router, with ECHO's plan) or ``"preprocess"`` (the
        dispatcher's) -- the part that never syncs with the host, so a CUDA graph can hold it.

        Returns the tensors :meth:`forward_tail` continues from and the host state it needs (the
        dispatch metadata's integers), which a graph keeps from its capture.
        """
        if stop not in HEAD_STOPS:
            raise ValueError(f"forward_head(stop={stop!r}): stop must be one of {HEAD_STOPS}.")
        hidden_size = self.config.hidden_size
        shared = self.shared_experts_compute(x)
        local = self.split_tokens(x)
        probs, routing_map, spare_homes = self.offload(*self.route(local))
        named: List[Tuple[str, Tensor]] = []
        meta: Optional[DispatchMetadata] = None
        meta_names: Tuple[str, ...] = ()
        if stop == "route":
            named += [("local", local), ("probs", probs), ("routing_map", routing_map)]
            if spare_homes is not None:
                named.append(("spare_homes", spare_homes))
        else:
            tokens, row_probs = self.preprocess(local.reshape(-1, hidden_size), probs, routing_map, spare_homes)
            tensors = self.dispatcher.meta.tensors()
            meta_names = tuple(tensors)
            cleared: Dict[str, Any] = {n: None for n in meta_names}
            meta = dataclasses.replace(self.dispatcher.meta, **cleared)
            named += [("tokens", tokens), ("row_probs", row_probs)] + [(f"meta.{n}", t) for n, t in tensors.items()]
        if shared is not None:
            named.append(("shared", shared))
        state = HeadState(stop, tuple(n for n, _ in named), tuple(local.shape), meta, meta_names)
        return tuple(t for _, t in named), state

    def forward_tail(self, outputs: Sequence[Tensor], state: "HeadState") -> Tensor:
        """The rest of ``forward`` from :meth:`forward_head`'s tensors (e.g. replayed by a graph):
        dispatch, experts and combine, whose shapes depend on the routing."""
        out = dict(zip(state.names, outputs))
        if state.stop == "route":
            tokens, row_probs = self.preprocess(out["local"].reshape(-1, self.config.hidden_size), out["probs"],
                                                out["routing_map"], out.get("spare_homes"))
        else:
            meta = dataclasses.replace(state.meta)
            meta.load_tensors({n: out[f"meta.{n}"] for n in state.meta_names})
            self.dispatcher = self._spare_dispatcher or self._home_dispatcher   # the head always plans
            self.dispatcher.meta = meta
            tokens, row_probs = out["tokens"], out["row_probs"]
        tokens, tokens_per_expert = self.dispatch(tokens, row_probs)
        y = self.combine(self.experts_compute(tokens, tokens_per_expert)).view(state.local_shape)
        y = self.unsplit_tokens(y)
        return y + out["shared"] if "shared" in out else y

    def head_modules(self) -> List[nn.Module]:
        """The submodules whose parameters :meth:`forward_head` uses."""
        shared: List[nn.Module] = [m for m in (self.shared_experts, self.shared_expert_gate) if m is not None]
        return [self.router, *shared]

    # -- the tp split of a replicated input ------------------------------------------------------
    def split_tokens(self, x: Tensor) -> Tensor:
        """A replicated input keeps only this rank's sequence slice (see the module docstring)."""
        if self.tp_size == 1 or self.sequence_parallel:
            return x
        if x.shape[0] % self.tp_size:
            raise ValueError(f"MoELayer splits a tp-replicated input along its first (sequence) dimension: "
                             f"{x.shape[0]} is not divisible by the tensor-parallel size {self.tp_size}; "
                             "use a sequence length divisible by tp, or sequence_parallel=True.")
        return scatter_to_sequence_parallel_region(x, self.groups.tp)

    def unsplit_tokens(self, x: Tensor) -> Tensor:
        """Undo :meth:`split_tokens`: the output gets the input's layout."""
        if self.tp_size == 1 or self.sequence_parallel:
            return x
        return gather_from_sequence_parallel_region(x, self.groups.tp, tensor_parallel_output_grad=False)
