"""Where a training step's gradients live, and how they become what one process would hold.

One object for the three ways a model's gradients are kept: plain ``param.grad`` (reduced by one
coalesced all-reduce per group after the schedule), contiguous buffers (``param.main_grad``;
bucketed, maybe overlapped with the backward), and buffers sharded by the distributed optimizer.
A step engine, or a plain training loop, calls it in this order::

    grads.zero()                     # first batch of an accumulation window
    with grads.no_sync(): ...        # every backward whose reduction must wait (accumulation)
    grads.finalize(modules)          # once, after the window's last backward
    grads.scale(result.grad_scale)   # per-token losses only: dp·cp / global token count
    grads.clip_by_norm(max_norm)     # optional: by the norm of the whole parallel model
    optimizer.step(); grads.after_optimizer_step()

A trainer that zeroes ``.grad`` between the step and its own backward (Lightning) can put the
gradients out of its reach with ``hide()`` and hand them back with ``expose()``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .config import GradientConfig
from ..parallel import ParallelState
from .clip import ClipPlan, clip_grad_norm, clip_plan, global_grad_norm, scale_grads_
from .data_parallel import DataParallelGrads, default_bucket_size
from .distributed_optimizer import DistributedOptimizer
from .finalize import finalize_model_grads
from .optimizer_state import FullOptimizerView


class GradientState:
    """The gradients of ``params`` under ``state``'s layout.

    ``optimizers``: the plain optimizers over the model (the distributed optimizer re-points them at its
    float32 shards). ``config``: the buffer options (the strategy's arguments of the same names); with none
    of them set, gradients stay in ``.grad``.
    """

    def __init__(self, params: Sequence[nn.Parameter], state: ParallelState, config: GradientConfig = GradientConfig(),
                 *, optimizers: Sequence[torch.optim.Optimizer] = (), modules: Sequence[nn.Module] = (),
                 device: Optional[torch.device] = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.state = state
        self.device = device
        self.buffers: Optional[DataParallelGrads] = None
        self.distributed_optimizer: Optional[DistributedOptimizer] = None
        self._hidden: List[Any] = []
        self._clip_plans: Dict[Tuple[int, ...], ClipPlan] = {}   # per optimizer parameter list
        if not config.uses_buffers:
            return
        dp_cp = state.size("dp-cp")
        self.buffers = DataParallelGrads(
            self.params, dense_group=state.dp_cp_group, expert_group=state.edp_group, divisor=dp_cp,
            overlap_grad_reduce=config.overlap_grad_reduce,
            bucket_size=config.bucket_size or default_bucket_size(config.overlap_grad_reduce, dp_cp),
            grad_reduce_in_fp32=config.grad_reduce_in_fp32, shard=config.use_distributed_optimizer,
            isolate=lambda p: state.pp_size > 1 and getattr(p, "shared_embedding", False))
        if config.use_distributed_optimizer:
            if state.tp_size > 1:
                self._check_buffers_line_up_over_tp()
            self.distributed_optimizer = DistributedOptimizer(list(optimizers), self.buffers, modules=list(modules),
                                                              overlap_param_gather=config.overlap_param_gather)

    @property
    def sharded(self) -> bool:
        return self.distributed_optimizer is not None

    def _check_buffers_line_up_over_tp(self) -> None:
        """Sequence-parallel gradients are summed over tp after the reduce-scatter: each rank's shard
        must hold the same elements on every tp peer."""
        state = self.state
        assert self.buffers is not None
        mine = torch.tensor([self.buffers.signature()], dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(state.tp_size)]
        dist.all_gather(everyone, mine, group=state.tp_group)
        if len({int(t) for t in everyone}) > 1:
            raise ValueError("use_distributed_optimizer=True needs the tensor-parallel ranks' parameters to have "
                             "the same shapes in the same order (their gradient buffers differ); build every tp "
                             "rank's model the same way, or set use_distributed_optimizer=False.")

    # -- one step --------------------------------------------------------------------------------------
    def zero(self) -> None:
        """Start an accumulation window from zero."""
        if self.buffers is not None:
            self.buffers.zero_grad()
        else:
            for param in self.params:
                param.grad = None

    def before_schedule(self) -> None:
        """With buffers, ``.grad`` must be unset (an attached ``.grad`` would make autograd accumulate into
        ``main_grad`` twice); plain gradients stay, to accumulate over the window."""
        if self.buffers is not None:
            self.hide()

    def no_sync(self) -> Any:
        """A context in which backward passes only accumulate (their reduction waits)."""
        return self.buffers.no_sync() if self.buffers is not None else nullcontext()

    @property
    def schedule_no_sync(self) -> Optional[Callable[[], Any]]:
        """What the pipeline executor wraps every backward but the last in (buffers only)."""
        return self.buffers.no_sync if self.buffers is not None else None

    def finalize(self, modules: Sequence[nn.Module]) -> None:
        """After the window's last backward: sequence-parallel, tied-embedding and data-parallel reductions."""
        finalize_model_grads(list(modules), self.state, grads=self.buffers, params=self.params)

    def scale(self, factor: torch.Tensor) -> None:
        """Multiply the finalized gradients by ``factor`` (a device scalar: no host sync), e.g. the step
        engine's ``grad_scale`` for per-token losses. Under the distributed optimizer the whole buffer is
        scaled; only this rank's shard is read. The factor is cast to each gradient dtype, as CUDA does for
        a device scalar anyway (and Megatron-Core's ``scale_gradients``): bf16 gradients are scaled by a
        factor within 0.2% of the exact one (``grad_reduce_in_fp32=True`` keeps it exact)."""
        if self.buffers is not None:
            scale_grads_([buffer.data for buffer in self.buffers.buffers], factor)
        else:
            scale_grads_([p.grad for p in self.params if p.grad is not None], factor)

    def clip_by_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``params`` (the optimizer's) so the whole model's norm is at most ``max_norm``."""
        return clip_grad_norm(params, float(max_norm), self.state, sharded=self.sharded, device=self.device,
                              plan=self._plan(params))

    def norm(self, params: Sequence[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm over ``params`` (the optimizer's), as one process computes it and the
        same on every rank (a collective)."""
        return global_grad_norm(params, self.state, norm_type, sharded=self.sharded, device=self.device,
                                plan=self._plan(params))

    def _plan(self, params: Sequence[nn.Parameter]) -> ClipPlan:
        key = tuple(map(id, params))
        plan = self._clip_plans.get(key)
        if plan is None:   # which parameters count is fixed for a parameter list: worked out once
            plan = self._clip_plans[key] = clip_plan(params, self.state)
        return plan

    def after_optimizer_step(self) -> None:
        """Make every rank's parameters whole again (the distributed optimizer stepped on its shards)."""
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.gather_params()

    def finish_param_sync(self) -> None:
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.finish_param_sync()

    # -- out of a trainer's reach between its step and its backward ------------------------------------
    def hide(self) -> None:
        """Take the gradients off ``.grad`` (a trainer's ``zero_grad`` then cannot touch them)."""
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.detach_grads()
        if self.buffers is not None:
            self.buffers.detach()
            return
        self._hidden = [(param, param.grad) for param in self.params]
        for param in self.params:
            param.grad = None

    def expose(self) -> None:
        """Put them back where the optimizer reads them."""
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.attach_grads()
        elif self.buffers is not None:
            self.buffers.attach()
        for param, grad in self._hidden:
            param.grad = grad
        self._hidden = []

    # -- checkpoints and the end -----------------------------------------------------------------------
    def gather_optimizer_states(self) -> Dict[int, FullOptimizerView]:
        """The whole optimizer state (host memory), kept for a save after the process groups are gone."""
        if self.distributed_optimizer is None:
            return {}
        return {id(opt): FullOptimizerView.gather(self.distributed_optimizer, opt, keep_optimizer=False)
                for opt in self.distributed_optimizer.optimizers}

    def reload_main_params(self) -> None:
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.reload_main_params()

    def close(self) -> None:
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.close()
        if self.buffers is not None:
            self.buffers.close()
        self.buffers, self.distributed_optimizer = None, None


def checkpoint_views(optimizers: Sequence[torch.optim.Optimizer], saving: bool,
                     distributed_optimizer: Optional[DistributedOptimizer],
                     gathered: Dict[int, FullOptimizerView]) -> List[Any]:
    """Each optimizer as the plain optimizer over the whole model, so one checkpoint format reshards with or
    without the distributed optimizer: a view gathered over data parallelism under it, the state gathered at
    the end of fit (``gathered``, saved after the groups are gone), else the optimizer itself."""
    out: List[Any] = []
    for optimizer in optimizers:
        if distributed_optimizer is not None and optimizer in distributed_optimizer.optimizers:
            out.append(FullOptimizerView.gather(distributed_optimizer, optimizer) if saving
                       else FullOptimizerView.to_load(distributed_optimizer, optimizer))
        elif saving and id(optimizer) in gathered:
            out.append(gathered[id(optimizer)])
        else:
            out.append(optimizer)
    return out
