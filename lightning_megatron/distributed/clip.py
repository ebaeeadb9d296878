"""Gradient norm and clipping over the whole model as one process would compute them.

Each element of the model counts once: tensor-parallel shards are summed over tp, replicated
parameters count on tp rank 0 only, the last stage's twin of the tied word embeddings does not
count, and pipeline stages are summed over pp (and expert shards over ep). Under the distributed
optimizer (``sharded=True``) the parameters are this rank's main shards, disjoint across data
parallelism: the local sums are then summed over the whole world, once.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ..parallel import ParallelState
from ..tensor_parallel.utils import param_is_not_tensor_parallel_duplicate


def _counted(param: nn.Parameter, state: ParallelState) -> bool:
    if getattr(param, "expert_parallel", False):
        # experts are split over ep (never duplicated there) and sharded or replicated over etp
        return getattr(param, "tensor_model_parallel", False) or state.etp_rank == 0
    if not param_is_not_tensor_parallel_duplicate(param, state.tp_rank):
        return False
    if getattr(param, "shared_embedding", False) and state.pp_size > 1:
        return state.is_pipeline_first_stage(ignore_virtual=True)   # the twin on the last stage is a copy
    return True


class ClipPlan(NamedTuple):
    """Which parameters count towards the norm, split by the group their sums are reduced over. The
    split depends only on the parameters and the layout: build it once per parameter list."""

    dense: List[nn.Parameter]
    expert: List[nn.Parameter]


def clip_plan(params: Iterable[nn.Parameter], state: ParallelState) -> ClipPlan:
    counted = [p for p in params if _counted(p, state)]
    return ClipPlan([p for p in counted if not getattr(p, "expert_parallel", False)],
                    [p for p in counted if getattr(p, "expert_parallel", False)])


@torch.no_grad()
def global_grad_norm(params: Iterable[nn.Parameter], state: ParallelState, norm_type: float = 2.0,
                     sharded: bool = False, device: Optional[torch.device] = None,
                     plan: Optional[ClipPlan] = None) -> torch.Tensor:
    """The norm of all gradients of the model, identical on every rank (a collective).

    ``sharded``: ``params`` are data-parallel shards (distributed optimizer). ``device``: where the
    reduction runs when this rank holds no gradient (default: the first gradient's device, or CPU).
    ``plan``: ``clip_plan(params, state)``, when the caller keeps it between steps.
    """
    params = list(params)
    plan = plan or clip_plan(params, state)
    first = next((p.grad for p in params if p.grad is not None), None)
    device = first.device if first is not None else (device or torch.device("cpu"))
    totals: List[torch.Tensor] = []
    local: Optional[torch.Tensor]
    for grads, name in ((_grads(plan.dense), "mp"), (_grads(plan.expert), "tp-ep-pp")):
        group = None if sharded else state.group(name)   # None: the world, i.e. also over the data shards
        alone = dist.get_world_size() == 1 if sharded else state.size(name) == 1   # nothing to reduce
        if alone and not grads:   # no term, no collective (a model without experts: one fewer kernel a step)
            continue
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else \
                torch.zeros((), device=device)
            if not alone:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        else:
            local = None
            for same in _by_device_and_dtype(grads).values():
                # one foreach kernel per device and dtype, each norm accumulated and returned in float32
                # (bf16 norms would round the total to ~3 digits; the clip coefficient needs it exact)
                norms = torch._foreach_norm(same, norm_type, dtype=torch.float32)
                part = torch.stack(norms).pow(norm_type).sum().to(device)
                local = part if local is None else local + part
            if local is None:
                local = torch.zeros((), device=device)
            if not alone:
                dist.all_reduce(local, group=group)
        totals.append(local)
    if not totals:
        return torch.zeros((), device=device)
    if math.isinf(norm_type):
        return functools.reduce(torch.maximum, totals)
    return functools.reduce(torch.add, totals) ** (1.0 / norm_type)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, state: ParallelState,
                   norm_type: float = 2.0, sharded: bool = False,
                   device: Optional[torch.device] = None, plan: Optional[ClipPlan] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the parallel model: same norm, same coefficient."""
    params = list(params)
    total = global_grad_norm(params, state, norm_type, sharded, device, plan)
    scale_grads_(_grads(params), torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@torch.no_grad()
def scale_grads_(grads: Iterable[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the device scalar ``factor`` (no host sync): one foreach kernel per
    (device, dtype), the factor cast to the gradients' dtype -- a float32 factor on bf16 gradients would take
    the slow type-promoting path, one kernel per tensor (bf16 gradients are so scaled by a bf16-rounded
    factor, as CUDA does for a device scalar anyway)."""
    for (grad_device, dtype), same in _by_device_and_dtype(grads).items():
        torch._foreach_mul_(same, factor.to(device=grad_device, dtype=dtype))


def _grads(params: Iterable[nn.Parameter]) -> List[torch.Tensor]:
    return [g for g in (p.grad for p in params) if g is not None]


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    """Tensors grouped so that each foreach kernel sees one device and one dtype (its fast path); torch's own
    grouping (C++, as its clip_grad_norm_ and optimizers use): a Python loop over a model's ~200 gradients cost
    more host time than the kernels it feeds. Callers run under ``no_grad`` (nothing to detach)."""
    tensors = list(tensors)
    if not tensors:   # torch's grouping refuses an empty list
        return {}
    grouped = _group_tensors_by_device_and_dtype([cast(List[Optional[torch.Tensor]], tensors)])
    return {key: cast(List[torch.Tensor], lists[0]) for key, (lists, _) in grouped.items()}
