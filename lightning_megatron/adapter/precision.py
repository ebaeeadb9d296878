"""Lightning's precision plugins, made right for a model split over ranks.

Lightning clips by the norm of the parameters one process holds and lets each process's loss
scaler skip steps on its own; with tensor/pipeline/expert shards both are wrong: the norm must be
the whole model's, and every rank must skip the same steps. These subclasses change exactly that,
through the hooks Lightning offers (``clip_grad_by_norm``/``clip_grad_by_value`` and the scaler's
``unscale_``), and otherwise behave as the plugin the user chose with ``precision=``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from ..distributed.gradients import GradientState

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


class ParallelGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose overflow check is agreed by every rank: a step is skipped everywhere
    when any shard found an inf/NaN (as ``ShardedGradScaler`` does for FSDP)."""

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.is_enabled() and self._scale is None:
            # pipeline stages before the last never scale a loss (they backpropagate scaled gradients
            # received from the next stage): start their scale where the last stage's starts
            device = next(p.device for group in optimizer.param_groups for p in group["params"])
            self.scale(torch.zeros((), device=device))
        super().unscale_(optimizer)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)


class _WholeModelClipping(Precision):
    """Clip by the norm of the whole parallel model (one reduction over every group that shards it); mixed in
    before the Lightning plugin it corrects."""

    gradients: Optional[GradientState] = None

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        if self.gradients is None:
            raise RuntimeError("gradient clipping outside fit: the megatron strategy has no gradients to clip.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.gradients.clip_by_norm(params, clip_val)

    @override
    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_value_(params, clip_val)   # elementwise: no communication needed


class ParallelPrecision(_WholeModelClipping, Precision):
    """``precision="32-true"``."""


class ParallelHalfPrecision(_WholeModelClipping, HalfPrecision):
    """``precision="bf16-true"``."""


class ParallelMixedPrecision(_WholeModelClipping, MixedPrecision):
    """``precision="bf16-mixed"`` / ``"16-mixed"`` (the latter with a :class:`ParallelGradScaler`)."""


def parallel_precision(plugin: Precision, gradients: Optional[GradientState]) -> Precision:
    """The parallel counterpart of the plugin Lightning chose for ``precision=``, clipping through
    ``gradients`` (``None`` outside fit). A plugin class we do not know cannot be made right: error."""
    if isinstance(plugin, _WholeModelClipping):
        plugin.gradients = gradients
        return plugin
    precision = getattr(plugin, "precision", None)
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(f"precision={precision!r} is not supported by the megatron strategy; use one of "
                         f"{list(SUPPORTED_PRECISION)}.")
    kind = type(plugin)
    if kind is Precision:
        out: _WholeModelClipping = ParallelPrecision()
    elif kind is HalfPrecision:
        out = ParallelHalfPrecision(precision)
    elif isinstance(plugin, MixedPrecision) and kind is MixedPrecision:
        out = ParallelMixedPrecision(precision, plugin.device, scaler=_parallel_scaler(plugin.scaler, plugin.device))
    else:
        raise ValueError(
            f"the megatron strategy clips by the whole model's norm and agrees on skipped steps across ranks, which "
            f"it can do only for Lightning's own precision plugins; got plugins=[{kind.__name__}(...)]. Pass "
            f"precision={precision!r} to the Trainer instead of a custom precision plugin.")
    out.gradients = gradients
    return out


def _parallel_scaler(scaler: Optional[Any], device: str) -> Optional[ParallelGradScaler]:
    """The user's scaler settings in a scaler whose ranks agree on overflow."""
    if scaler is None or isinstance(scaler, ParallelGradScaler):
        return scaler
    if type(scaler) is not torch.amp.GradScaler and not isinstance(scaler, torch.cuda.amp.GradScaler):
        raise ValueError(f"the megatron strategy needs torch.amp.GradScaler for precision='16-mixed'; got "
                         f"{type(scaler).__name__}.")
    return ParallelGradScaler(device, init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
                              growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                              growth_interval=scaler.get_growth_interval(), enabled=scaler.is_enabled())
