"""``TopKRouter``: token → expert assignment, balancing losses and the aux-loss-free expert bias."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..tensor_parallel.layers import InitMethod, init_method_normal, init_sharded_
from .aux_loss import (AttachAuxLoss, group_size, sequence_load_balancing_loss, sum_over, switch_load_balancing_loss,
                       z_loss)
from .pooled_aux_loss import AUX_LOSS_TYPES, AttachPooledLoss, PooledBalancingLoss, bind_pooled_loss, in_backward
from .routing import (
    DROP_POLICIES, SCORE_FUNCTIONS, apply_capacity, check_group_limits, expert_capacity, scores_for_aux_loss,
    topk_routing,
)


def _default_loss_group() -> Optional[dist.ProcessGroup]:
    from ..parallel import get_parallel_state, has_parallel_state

    return get_parallel_state().group("tp-cp") if has_parallel_state() else None


class TopKRouter(nn.Module):
    """Scores every token against every expert and picks ``topk`` of them.

    ``forward(x)`` takes this rank's tokens, ``[S, B, H]`` (sequence-first) or ``[T, H]``, and
    returns ``(probs, routing_map)``, both ``[T, E]`` (``T = S·B``): float32 probabilities (zero
    where a token does not go) and the boolean assignment. The balancing losses are attached to
    ``probs`` so their gradients flow in backward (see ``aux_loss``), and their values of the last
    forward are in ``self.aux_losses`` (this rank's partial sums over the tp-cp ``loss_group``).

    ``aux_loss_type`` chooses what ``aux_loss_coeff`` weighs: ``"per_layer"`` (default, Megatron-Core's: each
    layer's own Switch loss ``coeff·E/k·Σ_e f_e·P_e``, summed over layers) or ``"hf_pooled"`` (transformers'
    ``load_balancing_loss_func``: one ``coeff·E·Σ_e f_e·P_e`` over all layers' tokens pooled, what a model imported
    from a Hugging Face config with ``output_router_logits=True`` trains with; see ``pooled_aux_loss``).

    Aux-loss-free balancing (``enable_expert_bias``): a per-expert bias shifts the top-k
    selection only; token counts accumulate in training forwards and :meth:`update_expert_bias`
    (call it after the optimizer step) moves each bias by ``±rate`` toward the mean load.

    Capacity (``capacity_factor``): each expert keeps at most ``ceil(T·k/E·factor)`` of this
    rank's tokens (by probability or position); ``pad_to_capacity`` makes it exactly that many,
    so the dispatch has static shapes.
    """

    # buffers with enable_expert_bias, else None
    expert_bias: Optional[Tensor]
    local_tokens_per_expert: Optional[Tensor]

    def __init__(self, hidden_size: int, num_experts: int, topk: int, *, score_function: str = "softmax",
                 pre_softmax: bool = False, num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 scaling_factor: Optional[float] = None, aux_loss_coeff: float = 0.0,
                 seq_aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, aux_loss_type: str = "per_layer",
                 enable_expert_bias: bool = False,
                 expert_bias_update_rate: float = 1e-3, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", pad_to_capacity: bool = False,
                 init_method: Optional[InitMethod] = None, params_dtype: torch.dtype = torch.float32,
                 device: Optional[Union[torch.device, str]] = None,
                 loss_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}].")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}.")
        if score_function == "sigmoid" and pre_softmax:
            raise ValueError("pre_softmax=True only applies to score_function='softmax'.")
        check_group_limits(num_experts, topk, num_groups, group_topk)
        if scaling_factor is not None and scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be positive, got {scaling_factor}.")
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("seq_aux_loss_coeff", seq_aux_loss_coeff),
                            ("z_loss_coeff", z_loss_coeff)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        if aux_loss_type not in AUX_LOSS_TYPES:
            raise ValueError(f"aux_loss_type must be one of {AUX_LOSS_TYPES}, got {aux_loss_type!r}.")
        if aux_loss_type == "hf_pooled" and score_function != "softmax":
            raise ValueError("aux_loss_type='hf_pooled' (transformers' loss, on a softmax over every expert) needs "
                             f"score_function='softmax', got {score_function!r}.")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}.")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs a capacity_factor (e.g. 1.0).")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}.")
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.num_groups, self.group_topk, self.scaling_factor = num_groups, group_topk, scaling_factor
        self.aux_loss_coeff, self.seq_aux_loss_coeff = aux_loss_coeff, seq_aux_loss_coeff
        self.z_loss_coeff, self.aux_loss_type = z_loss_coeff, aux_loss_type
        self.pooled_loss: Optional[PooledBalancingLoss] = None   # hf_pooled: set_aux_loss_scale binds it per step
        self.capacity_factor, self.drop_policy, self.pad_to_capacity = capacity_factor, drop_policy, pad_to_capacity
        self.expert_bias_update_rate = expert_bias_update_rate
        self.aux_loss_scale = 1.0
        self.aux_loss_per_token = False   # see aux_loss.py: set with set_aux_loss_scale
        self.aux_losses: Dict[str, Tensor] = {}
        self._explicit_loss_group = loss_group

        # Replicated on every rank; drawn like a TP=1 weight so every layout starts identical.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype, device=device))
        init_sharded_(self.weight, (num_experts, hidden_size), 0, init_method or init_method_normal(), 0, 1)
        if enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(num_experts, dtype=torch.float32, device=device), persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None

    @property
    def loss_group(self) -> Optional[dist.ProcessGroup]:
        """The tp-cp group whose ranks hold slices of the same sequences (counts are summed there)."""
        return self._explicit_loss_group if self._explicit_loss_group is not None else _default_loss_group()

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Per-expert capacity for ``num_tokens`` local tokens, or None when dropless."""
        if self.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, self.num_experts, self.topk, self.capacity_factor)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"TopKRouter expects hidden size {self.hidden_size}, got input {tuple(x.shape)}.")
        if self.seq_aux_loss_coeff > 0 and x.dim() != 3:
            raise ValueError("seq_aux_loss_coeff > 0 needs the input shaped [seq, batch, hidden] "
                             f"(sequence-first) to find sequences; got {tuple(x.shape)}.")
        tokens = x.reshape(-1, self.hidden_size)
        logits = F.linear(tokens.float(), self.weight.float())                           # [T, E]
        probs, routing_map = topk_routing(
            logits, self.topk, self.score_function, self.pre_softmax, self.expert_bias,
            self.num_groups, self.group_topk, self.scaling_factor)
        if self.training and torch.is_grad_enabled() and self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert += routing_map.sum(dim=0)   # the router's choice, before dropping
        aux = self._aux_loss(x, logits, routing_map)
        capacity = self.capacity(tokens.shape[0])   # None: dropless
        if capacity is not None:
            probs, routing_map = apply_capacity(probs, routing_map, capacity, self.drop_policy, self.pad_to_capacity)
        if aux is not None and aux.requires_grad:
            probs = AttachAuxLoss.apply(probs, aux, self._aux_gradient_scale(tokens.shape[0]))
        if self.aux_loss_type == "hf_pooled" and self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            probs = self._attach_pooled_loss(logits, routing_map, probs, tokens.shape[0])
        return probs, routing_map

    def _attach_pooled_loss(self, logits: Tensor, routing_map: Tensor, probs: Tensor, local_tokens: int) -> Tensor:
        """Record this layer's statistics in the model's ledger; attach the pooled loss's gradient (``pooled_aux_loss``)."""
        ledger = self.pooled_loss
        if ledger is None:
            raise RuntimeError("aux_loss_type='hf_pooled' pools over every MoE layer of the model: call "
                               "set_aux_loss_scale(model, scale) before each training step (the strategy's engine "
                               "does) so that its routers share one ledger.")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("aux_loss_type='hf_pooled' runs eagerly only (its ledger is Python): drop cuda_graph.")
        scores = torch.softmax(logits.float(), dim=-1)
        if in_backward():   # a checkpointed layer recomputing its forward: recorded the first time
            return cast(Tensor, AttachPooledLoss.apply(probs, scores, None, -1, 0.0, 0.0))
        group = self.loss_group
        stats = torch.cat([routing_map.sum(dim=0).float(), scores.detach().sum(dim=0),
                           scores.new_full((1,), float(local_tokens))])
        mb = ledger.record(self, sum_over(stats, group))
        value = torch.zeros((), device=logits.device)
        if self is ledger.routers[-1] and ledger.is_last_stage:   # the whole loss, reported once (see the module)
            value = ledger.loss(mb, self.aux_loss_coeff, self.num_experts, logits.device) / group_size(group)
        self.aux_losses = dict(self.aux_losses, load_balancing_loss=value)
        return cast(Tensor, AttachPooledLoss.apply(probs, scores, ledger, mb, self.aux_loss_coeff,
                                                   self._aux_gradient_scale(local_tokens)))

    def _aux_gradient_scale(self, local_tokens: int) -> float:
        """``aux_loss_scale``, times the micro-batch's token count (all ranks of the tp-cp group) with
        per-token main losses."""
        if not self.aux_loss_per_token:
            return self.aux_loss_scale
        group = self.loss_group
        return self.aux_loss_scale * local_tokens * (1 if group is None else dist.get_world_size(group))

    def _aux_loss(self, x: Tensor, logits: Tensor, routing_map: Tensor) -> Optional[Tensor]:
        losses: Dict[str, Tensor] = {}
        group = self.loss_group
        if (self.aux_loss_coeff > 0 and self.aux_loss_type == "per_layer") or self.seq_aux_loss_coeff > 0:
            scores = scores_for_aux_loss(logits, self.score_function)
            if self.aux_loss_coeff > 0 and self.aux_loss_type == "per_layer":
                losses["load_balancing_loss"] = switch_load_balancing_loss(
                    scores, routing_map, self.topk, self.aux_loss_coeff, group)
            if self.seq_aux_loss_coeff > 0:
                shape = (x.shape[0], x.shape[1], self.num_experts)
                losses["seq_load_balancing_loss"] = sequence_load_balancing_loss(
                    scores.view(shape), routing_map.view(shape), self.topk, self.seq_aux_loss_coeff, group)
        if self.z_loss_coeff > 0:
            losses["z_loss"] = z_loss(logits, self.z_loss_coeff, group)
        self.aux_losses = {name: value.detach() for name, value in losses.items()}
        return cast(Tensor, sum(losses.values())) if losses else None

    @torch.no_grad()
    def update_expert_bias(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """One aux-loss-free step: ``bias += rate · sign(mean load - load)``, then reset the counts.

        ``group``: the ranks that routed different tokens through this layer (tp-dp-cp), so every
        replica applies the same update. See :func:`update_expert_biases` for a whole model.
        """
        update_expert_biases([self], group)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, experts={self.num_experts}, topk={self.topk}, "
                f"score={self.score_function}, capacity_factor={self.capacity_factor}, "
                f"pad_to_capacity={self.pad_to_capacity}, expert_bias={self.expert_bias is not None}")


@torch.no_grad()
def update_expert_biases(module: Union[nn.Module, Iterable[TopKRouter]],
                         group: Optional[dist.ProcessGroup] = None) -> None:
    """Update every aux-loss-free router in ``module`` with one all-reduce of their token counts.

    Call after the optimizer step. ``group`` defaults to the active state's tp-dp-cp group.
    """
    candidates = list(module.modules()) if isinstance(module, nn.Module) else list(module)
    routers = [r for r in candidates if isinstance(r, TopKRouter) and r.expert_bias is not None]
    if not routers:
        return
    if group is None:
        from ..parallel import get_parallel_state, has_parallel_state

        group = get_parallel_state().group("tp-dp-cp") if has_parallel_state() else None
    counts = torch.stack([cast(Tensor, r.local_tokens_per_expert) for r in routers])   # registered with expert_bias
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    direction = torch.sign(counts.mean(dim=1, keepdim=True) - counts)
    for router, step in zip(routers, direction):   # the rate as a kernel argument: no host-to-device copy
        assert router.expert_bias is not None and router.local_tokens_per_expert is not None
        router.expert_bias.add_(step, alpha=router.expert_bias_update_rate)
        router.local_tokens_per_expert.zero_()


def _routers(module: nn.Module) -> List[TopKRouter]:
    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def set_aux_loss_scale(module: Union[nn.Module, Iterable[TopKRouter]], scale: float, per_token: bool = False) -> None:
    """Set the gradient scale of every router's balancing losses in ``module`` (or of the given routers:
    a training loop that sets it every step finds them once).

    Call it with the factor the main loss is multiplied by (e.g. ``1 / num_microbatches``).
    ``per_token``: the main loss is a per-token sum whose gradients are later divided by the global
    token count; each balancing loss is then also multiplied by its micro-batch's token count.
    Routers with ``aux_loss_type="hf_pooled"`` get a fresh shared ledger for the step (``pooled_aux_loss``).
    """
    routers = _routers(module) if isinstance(module, nn.Module) else list(module)
    for router in routers:
        router.aux_loss_scale = float(scale)
        router.aux_loss_per_token = bool(per_token)
    bind_pooled_loss(routers)


def collect_aux_losses(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> Dict[str, Tensor]:
    """Sum each balancing loss of the last forward over every router in ``module``, for logging.

    Values stay on the device (no host sync). Pass the tp-cp ``group`` to get the whole-sequence
    value (each rank holds a partial sum); without it the values are this rank's parts.
    """
    totals: Dict[str, Tensor] = {}
    for router in _routers(module):
        for name, value in router.aux_losses.items():
            totals[name] = totals[name] + value if name in totals else value.clone()
    if group_size(group) > 1 and totals:
        names = sorted(totals)
        flat = sum_over(torch.stack([totals[n] for n in names]), group)
        totals = {n: flat[i] for i, n in enumerate(names)}
    return totals
