"""How the model and the batch are split: the strategy's layout arguments as one typed, validated value.

Field names are the strategy's (and Megatron-LM's) argument names, so an error names what the user
wrote. Frozen: the machinery receives it, never changes it. The checks that need the world size (does
the layout divide it?) are in :meth:`ParallelConfig.layout`, a pure function every rank runs before
any process group exists.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

from .topology import DEFAULT_ORDER, ParallelLayout, check_size


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and the batch are split (see ``MegatronStrategy`` for each field)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    order: str = DEFAULT_ORDER
    sequence_parallel: bool = False
    micro_batch_size: Optional[int] = None
    microbatch_group_size_per_vp_stage: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            check_size(name, getattr(self, name))
        for name in ("expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size", "micro_batch_size",
                     "microbatch_group_size_per_vp_stage"):
            if getattr(self, name) is not None:
                check_size(name, getattr(self, name))
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1:
            if self.pipeline_model_parallel_size == 1:
                raise ValueError(f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size "
                                 ">= 2; raise it or drop the virtual stages.")
            if self.micro_batch_size is None:
                raise ValueError("virtual_pipeline_model_parallel_size > 1 needs micro_batch_size: the interleaved "
                                 "schedule needs at least pipeline_model_parallel_size micro-batches per step.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn("sequence_parallel=True does nothing with tensor_model_parallel_size=1 (it shards "
                          "activations over tensor-parallel ranks): turned off. Set tensor_model_parallel_size "
                          ">= 2 to use it.", UserWarning, stacklevel=3)
            object.__setattr__(self, "sequence_parallel", False)

    def layout(self, world_size: int) -> ParallelLayout:
        """The rank grid over ``world_size`` processes (raises, naming the sizes, if they do not divide it)."""
        return ParallelLayout(world_size, tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                              cp=self.context_parallel_size, ep=self.expert_model_parallel_size,
                              etp=self.expert_tensor_parallel_size, order=self.order)


__all__ = ["ParallelConfig"]
