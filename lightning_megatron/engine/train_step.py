"""The whole training-step protocol, in one place, for any driver (a plain loop or the Lightning adapter).

Modelled on torchtitan's ``train_step`` and Megatron-Core's ``finalize_model_grads``: zero the
gradients at the start of an accumulation window, run the schedule with the data-parallel reduction
deferred until the window's last backward, finalize (sequence-parallel, tied-embedding and
data-parallel reductions), scale per-token gradients by the global token count, clip by the whole
model's norm, step, then the post-optimizer obligations: the distributed optimizer's parameter
gather and the aux-loss-free MoE expert-bias update. Those are registered when the step is built,
not remembered by the caller, so a loop cannot miss one::

    train = TrainStep(StepEngine(model, state, device=device, micro_batch_size=2),
                      GradientState(params, state, config, optimizers=[opt], modules=[model]), [model])
    for batch in data:
        result = train.step(batch, loss_fn, opt, max_norm=1.0)   # result.loss, result.logs

A driver that interleaves its own hooks (Lightning: the optimizer step in ``optimizer_step``, clipping in
the precision plugin) calls the parts: ``run``, then ``clip_grad_norm``, its ``optimizer.step()``, then
``after_optimizer_step``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, List, Optional, Sequence

import torch
from torch import nn

from ..distributed.gradients import GradientState
from ..moe import MoELayer, update_expert_biases
from ..parallel.heartbeat import HEARTBEAT
from .step import LastStage, StepEngine, StepResult


class TrainStep:
    """One optimizer step of ``modules`` (this rank's part of the model) with ``engine`` and ``gradients``.

    ``post_optimizer_hooks``: more callables to run after every optimizer step, after the built-in ones.
    """

    def __init__(self, engine: StepEngine, gradients: GradientState, modules: Sequence[nn.Module],
                 post_optimizer_hooks: Sequence[Callable[[], None]] = ()) -> None:
        self.engine, self.gradients, self.modules = engine, gradients, list(modules)
        self.post_optimizer_hooks: List[Callable[[], None]] = [gradients.after_optimizer_step]
        routers = [r for r in engine.routers if r.expert_bias is not None]
        if routers:   # aux-loss-free balancing: biases move after the step, from the tokens counted in it
            group = engine.state.group("tp-dp-cp")
            self.post_optimizer_hooks.append(lambda: update_expert_biases(routers, group=group))
        schedules = [m.echo for module in self.modules for m in module.modules()
                     if isinstance(m, MoELayer) and m.echo is not None]
        if schedules:   # ECHO plans in the next step only if this one's routing needed it (moe/echo_schedule.py)
            def next_echo_step() -> None:
                for schedule in schedules:
                    schedule.next_step()
            self.post_optimizer_hooks.append(next_echo_step)
        self.post_optimizer_hooks.extend(post_optimizer_hooks)

    def run(self, batch: Any, last_stage: LastStage, *, window_start: bool = True, window_end: bool = True,
            step_context: Callable[[], ContextManager[Any]] = torch.enable_grad, aux_loss_scale: float = 1.0,
            extras: Optional[Callable[[], Any]] = None) -> StepResult:
        """Forward and backward of every micro-batch of ``batch``; at ``window_end`` (the last batch of an
        accumulation window) the gradients are finalized and, for per-token losses, scaled: then they are what
        one process would hold, in ``.grad`` where the optimizer reads them. ``aux_loss_scale``: the factor
        of the backpropagated loss (loss scale / accumulation) that MoE balancing losses must share."""
        gradients = self.gradients
        if window_start:
            gradients.zero()
        gradients.before_schedule()
        with nullcontext() if window_end else gradients.no_sync():
            result = self.engine.run(batch, last_stage, step_context=step_context, no_sync=gradients.schedule_no_sync,
                                     aux_loss_scale=aux_loss_scale, extras=extras)
        if window_end:
            HEARTBEAT.at("finalize gradients (data-parallel reduce, tied embeddings)", waiting=True)
            gradients.finalize(self.modules)
            if result.grad_scale is not None:   # per-token losses: divided by the global token count
                gradients.scale(result.grad_scale)
        gradients.expose()
        HEARTBEAT.end()   # the driver's loop goes on: clipping, its optimizer step, callbacks, logging
        return result

    def clip_grad_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``params`` (the optimizer's) so the whole parallel model's norm is at most
        ``max_norm``; returns the norm before clipping, the same on every rank."""
        HEARTBEAT.at("clipping: the gradient norm's all-reduce", waiting=True)
        norm = self.gradients.clip_by_norm(params, max_norm)
        HEARTBEAT.at(None)
        return norm

    def after_optimizer_step(self) -> None:
        """Every post-optimizer obligation, in order: parameters whole again, expert biases moved, the
        caller's hooks."""
        HEARTBEAT.at("after the optimizer step (parameter gather, expert biases, hooks)", waiting=True)
        for hook in self.post_optimizer_hooks:
            hook()
        HEARTBEAT.at(None)

    def step(self, batch: Any, last_stage: LastStage, optimizer: torch.optim.Optimizer, *,
             max_norm: Optional[float] = None) -> StepResult:
        """``run`` a whole window of one batch, clip (``max_norm``), ``optimizer.step()``, then
        ``after_optimizer_step``."""
        result = self.run(batch, last_stage)
        if max_norm is not None:
            self.clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], max_norm)
        optimizer.step()
        self.after_optimizer_step()
        return result
