"""How the model and the batch are split: the strategy's layout arguments as one typed, validated value.

Field names are the strategy's (and Megatron-LM's) argument names, so an error names what the user
wrote. Frozen: the machinery receives it, never changes it. The checks that need the world size (does
the layout divide it?) are in :meth:`ParallelConfig.layout`, a pure function every rank runs before
any process group exists.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, Optional

from .topology import DEFAULT_ORDER, ParallelConfigError, ParallelLayout, check_size

# "1f1b": 1F1B, interleaved with virtual stages; "zb-h1": zero-bubble 1F1B (pipeline/zero_bubble.py)
PIPELINE_SCHEDULES = ("1f1b", "zb-h1")


def check_pipeline_schedule(name: object, num_model_chunks: int = 1) -> str:
    """``name`` if it is a schedule that runs with ``num_model_chunks`` chunks per rank, else one clear error."""
    if name not in PIPELINE_SCHEDULES:
        raise ParallelConfigError(f"pipeline_schedule={name!r} is not one of {', '.join(map(repr, PIPELINE_SCHEDULES))}.")
    if name == "zb-h1" and num_model_chunks > 1:
        raise ParallelConfigError(
            f"pipeline_schedule='zb-h1' runs one model chunk per stage, but virtual_pipeline_model_parallel_size="
            f"{num_model_chunks}: drop the virtual stages, or use pipeline_schedule='1f1b' (interleaved).")
    return str(name)


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
    pipeline_schedule: str = "1f1b"
    tp_comm_overlap: bool = False

    def __post_init__(self) -> None:
        check_pipeline_schedule(self.pipeline_schedule, self.virtual_pipeline_model_parallel_size or 1)
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
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap=True overlaps sequence parallelism's gathers and reduce-scatters with "
                             "the GEMMs: it needs sequence_parallel=True and tensor_model_parallel_size >= 2.")
        if self.tp_comm_overlap and self.pipeline_schedule == "zb-h1":
            raise ValueError("tp_comm_overlap=True does not combine with pipeline_schedule='zb-h1' yet (its deferred "
                             "weight gradients); use pipeline_schedule='1f1b' or tp_comm_overlap=False.")

    def model_defaults(self) -> Dict[str, bool]:
        """What models built in ``configure_model`` take from the strategy (``model_defaults``)."""
        return dict(sequence_parallel=self.sequence_parallel, tp_comm_overlap=self.tp_comm_overlap)

    def layout(self, world_size: int) -> ParallelLayout:
        """The rank grid over ``world_size`` processes (raises, naming the sizes, if they do not divide it)."""
        return ParallelLayout(world_size, tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                              cp=self.context_parallel_size, ep=self.expert_model_parallel_size,
                              etp=self.expert_tensor_parallel_size, order=self.order)


__all__ = ["PIPELINE_SCHEDULES", "ParallelConfig", "check_pipeline_schedule"]
