"""Hugging Face's load-balancing loss (``aux_loss_type="hf_pooled"``): one loss pooled over every MoE layer.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE, Qwen3-MoE with ``output_router_logits=True``; the
training loss adds ``router_aux_loss_coef`` times it) concatenates the router logits of all L layers of a forward
(T tokens each) and returns ``E · Σ_e f_e · P_e``: ``f_e`` = top-k selections of expert e over all layers' tokens
/ (L·T), ``P_e`` = softmax probability of e summed over all layers' tokens / (L·T). Megatron's loss is a sum of
per-layer terms; this one is not, since f and P pool over the layers: the two differ by far more than a factor.

The counts are not differentiable, so the loss's gradient with respect to every probability ``p[l, t, e]`` is
``coef · E · C_e / N²`` (``C_e`` = all layers' selections of e, ``N = L·T``): one constant per expert, the same
for every layer and token. Each router attaches, in forward, a node whose backward sends that constant to its
softmax scores (:class:`AttachPooledLoss`); the constant needs every layer's counts, all known by then:

- tokens split over tp (sequence parallelism, the MoE layer's token split) and cp: the router all-reduces its
  counts, probability sums and token count over the tp-cp group in forward, as for the per-layer losses;
- the layers of this rank: summed in a :class:`PooledBalancingLoss` ledger that ``set_aux_loss_scale`` gives the
  model's routers every step, per micro-batch (a router's n-th training forward of the step is micro-batch n);
- the layers of other pipeline stages: when a stage's last router has run, one asynchronous all-reduce of the
  stage's sums goes over the pipeline stages (their host group). Every stage's forward of a micro-batch precedes
  every stage's backward of it, so the backward (and the last stage, for the value it reports) waits for a
  collective every stage has already issued. Virtual pipeline stages are refused (a stage would hold several
  chunks whose ends the routers cannot tell); every pipeline stage needs at least one MoE layer.
- data parallelism: each replica's micro-batch has its own loss, as when transformers trains under DDP or
  gradient accumulation (one loss per forward).

Reported: the whole loss, on the last stage's last router, divided by the tp-cp size (``collect_aux_losses`` over
the tp-cp group gives it once); every other router reports zero. transformers leaves the tokens its
``attention_mask`` masks out of the loss; the MoE layers here see no mask, so ``GPTModel`` refuses a training forward
with an ``attention_mask`` under this loss (packed rows have no padding).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

AUX_LOSS_TYPES = ("per_layer", "hf_pooled")


def in_backward() -> bool:
    """Whether autograd is running a backward pass (a checkpointed layer recomputing its forward)."""
    return torch._C._current_graph_task_id() != -1


class _MicroBatch:
    """One micro-batch's sums on this rank (``[counts E, probability sums E, tokens 1]``) and their total."""

    def __init__(self) -> None:
        self.local: Optional[Tensor] = None
        self.total: Optional[Tensor] = None
        self.pending: Optional[Tuple[Any, Tensor]] = None   # (async work, host buffer) under pipelining
        self.backwards = 0


class PooledBalancingLoss:
    """The ledger the ``hf_pooled`` routers of one model on one rank share for a step (see the module doc).

    ``routers`` in module order: on one pipeline stage the last of them runs last in every forward.
    ``pp_group``: the pipeline stages' host group, or None without pipelining.
    """

    def __init__(self, routers: Sequence[nn.Module], pp_group: Optional[dist.ProcessGroup] = None) -> None:
        if not routers:
            raise ValueError("PooledBalancingLoss needs at least one router.")
        self.routers = list(routers)
        self.pp_group = pp_group if pp_group is not None and dist.get_world_size(pp_group) > 1 else None
        self.is_last_stage = self.pp_group is None or dist.get_rank(self.pp_group) == dist.get_world_size(
            self.pp_group) - 1
        self._calls: Dict[int, int] = {}
        self._batches: Dict[int, _MicroBatch] = {}

    def close(self) -> None:
        """Complete any collective still in flight (every stage issued the same ones) and forget the step."""
        for batch in self._batches.values():
            if batch.pending is not None:
                batch.pending[0].wait()
        self._batches.clear()
        self._calls.clear()

    def record(self, router: nn.Module, stats: Tensor) -> int:
        """Add one router's forward (``stats`` summed over tp-cp) to its micro-batch; returns the micro-batch."""
        mb = self._calls.get(id(router), 0)
        self._calls[id(router)] = mb + 1
        batch = self._batches.setdefault(mb, _MicroBatch())
        batch.local = stats if batch.local is None else batch.local + stats
        if router is self.routers[-1]:   # this stage's forward of the micro-batch is over
            if self.pp_group is None:
                batch.total = batch.local
            else:
                buffer = batch.local.detach().to("cpu", copy=True)
                batch.pending = (dist.all_reduce(buffer, group=self.pp_group, async_op=True), buffer)
        return mb

    def total(self, mb: int, device: torch.device) -> Tensor:
        """Every layer's ``[counts, probability sums, tokens]`` of micro-batch ``mb`` (waits for the stages)."""
        batch = self._batches[mb]
        if batch.total is None:
            if batch.pending is None:
                raise RuntimeError("hf_pooled balancing loss: the stage's last router has not run its forward for "
                                   f"micro-batch {mb}; every MoE layer of a stage must run in each forward.")
            work, buffer = batch.pending
            work.wait()
            batch.total, batch.pending = buffer.to(device), None
        return batch.total

    def loss(self, mb: int, coeff: float, num_experts: int, device: torch.device) -> Tensor:
        """The whole pooled loss of micro-batch ``mb`` (a value: no gradient)."""
        total = self.total(mb, device)
        counts, probs, tokens = total[:num_experts], total[num_experts:-1], total[-1]
        return (counts * probs).sum() * (coeff * num_experts) / (tokens * tokens)

    def gradient(self, mb: int, coeff: float, num_experts: int, device: torch.device) -> Tensor:
        """``coef · E · C_e / N²``, the loss's gradient with respect to each probability, per expert."""
        total = self.total(mb, device)
        grad = total[:num_experts] * (coeff * num_experts) / (total[-1] * total[-1])
        batch = self._batches[mb]
        batch.backwards += 1
        if batch.backwards == sum(1 for _ in self.routers):   # every router's backward read it
            del self._batches[mb]
        return grad


class AttachPooledLoss(torch.autograd.Function):
    """Identity on ``probs``; in backward, sends the pooled loss's gradient (times ``scale``) to ``scores``."""

    @staticmethod
    def forward(ctx: Any, probs: Tensor, scores: Tensor, ledger: Optional[PooledBalancingLoss], mb: int,
                coeff: float, scale: float) -> Tensor:
        ctx.ledger, ctx.mb, ctx.coeff, ctx.scale = ledger, mb, coeff, scale
        ctx.scores_shape, ctx.scores_dtype = scores.shape, scores.dtype
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        num_experts = ctx.scores_shape[-1]
        per_expert = ctx.ledger.gradient(ctx.mb, ctx.coeff, num_experts, grad.device) * ctx.scale
        scores_grad = per_expert.to(ctx.scores_dtype).expand(ctx.scores_shape).contiguous()
        return grad, scores_grad, None, None, None, None


def check_pooled_layout(config: Any, layout: Sequence[int], pp_size: int, vp_size: Optional[int]) -> None:
    """At model build, the same on every rank: ``hf_pooled`` across pipeline stages needs every stage to hold an MoE
    layer (each joins the stages' all-reduce) and no virtual stages; refused with the fix instead of a hang."""
    moe = getattr(config, "moe", None)
    if moe is None or getattr(moe, "aux_loss_type", "per_layer") != "hf_pooled" or pp_size <= 1:
        return
    if (vp_size or 1) > 1:
        raise ValueError("aux_loss_type='hf_pooled' (Hugging Face's loss pooled over all layers) is not supported "
                         f"with virtual pipeline stages (virtual_pipeline_model_parallel_size={vp_size}); use "
                         "aux_loss_type='per_layer' or no virtual stages.")
    first = 0
    for stage, count in enumerate(layout):
        if not any(config.is_moe_layer(first + i + 1) for i in range(count)):
            raise ValueError(f"aux_loss_type='hf_pooled' needs an MoE layer on every pipeline stage, and stage {stage} "
                             f"of pipeline_layout={list(layout)} has none: choose a pipeline_layout (or "
                             f"pipeline_model_parallel_size) that gives each stage one.")
        first += count


def bind_pooled_loss(routers: Sequence[Any]) -> Optional[PooledBalancingLoss]:
    """Give the ``hf_pooled`` routers among ``routers`` (a model's, in module order) a fresh ledger for a step."""
    pooled: List[Any] = [r for r in routers if getattr(r, "aux_loss_type", None) == "hf_pooled"
                         and r.aux_loss_coeff > 0]
    if not pooled:
        return None
    for router in pooled:
        if router.pooled_loss is not None:
            router.pooled_loss.close()
    pp_group = None
    from ..parallel import get_parallel_state, has_parallel_state

    if has_parallel_state():
        state = get_parallel_state()
        if state.pp_size > 1:
            if (state.virtual_pipeline_size or 1) > 1:
                raise ValueError("aux_loss_type='hf_pooled' (Hugging Face's loss pooled over all layers) is not "
                                 "supported with virtual pipeline stages (virtual_pipeline_model_parallel_size="
                                 f"{state.virtual_pipeline_size}); use 'per_layer' or no virtual stages.")
            pp_group = state.pp_host_group
    ledger = PooledBalancingLoss(pooled, pp_group)
    for router in pooled:
        router.pooled_loss = ledger
    return ledger
