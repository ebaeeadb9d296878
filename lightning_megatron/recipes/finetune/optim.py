"""AdamW with linear warm-up and linear decay to zero, as BERT fine-tuning recipes use.

Biases and normalization weights (every 1-D parameter) take no weight decay. The schedule is a
pure function of the step so that it can be checked by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig


def warmup_linear_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor at ``step``: 0 → 1 over ``warmup_steps``, then 1 → 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    return max(0.0, (total_steps - step) / (total_steps - warmup_steps))


def param_groups(module: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    decay: List[nn.Parameter] = []
    no_decay: List[nn.Parameter] = []
    for param in module.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_with_warmup(module: nn.Module, lr: float, weight_decay: float, betas: Tuple[float, float], eps: float,
                      warmup_fraction: float, total_steps: int) -> OptimizerLRSchedulerConfig:
    """What ``configure_optimizers`` returns: AdamW and a per-step warm-up + linear-decay schedule."""
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}.")
    if total_steps < 1:
        raise ValueError(f"the run has {total_steps} optimizer steps; set max_epochs or max_steps so it has some.")
    betas = cast(Tuple[float, float], tuple(betas))   # a list when read from a config file
    optimizer = torch.optim.AdamW(param_groups(module, weight_decay), lr=lr, betas=betas, eps=eps)
    warmup = int(warmup_fraction * total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_linear_decay(step, warmup, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


