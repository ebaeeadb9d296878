"""Where gradients live and how they are reduced: the strategy's gradient arguments as one validated value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..parallel.topology import check_size


@dataclass(frozen=True)
class GradientConfig:
    """Where gradients live and how they are reduced (the arguments of ``GradientState``)."""

    overlap_grad_reduce: bool = False
    bucket_size: Optional[int] = None
    grad_reduce_in_fp32: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False

    def __post_init__(self) -> None:
        if self.bucket_size is not None:
            check_size("bucket_size", self.bucket_size)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True gathers the distributed optimizer's shards; set "
                             "use_distributed_optimizer=True as well, or drop overlap_param_gather.")

    @property
    def uses_buffers(self) -> bool:
        return (self.overlap_grad_reduce or self.use_distributed_optimizer or self.grad_reduce_in_fp32
                or self.bucket_size is not None)


__all__ = ["GradientConfig"]
