"""The strategy's settings as typed, validated values, checked in one place before any process group exists.

Field names are the strategy's (and Megatron-LM's) argument names, so an error names what the user
wrote. Each object is frozen: the machinery receives it, never changes it. The checks that need the
world size (does the layout divide it?) are in :meth:`ParallelConfig.layout`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Union

from .parallel import ParallelLayout
from .parallel.topology import DEFAULT_ORDER, check_size

CUDA_GRAPH_MODES = (None, "partial", "full")
CUDA_GRAPH_BACKENDS = ("cuda", "eager")


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


@dataclass(frozen=True)
class CudaGraphConfig:
    """Which CUDA graphs the step engine captures (the arguments of ``StepEngine``)."""

    cuda_graph: Optional[str] = None
    cuda_graph_scope: Union[str, List[str]] = "layer"
    cuda_graph_warmup_steps: int = 1
    cuda_graph_backend: str = "cuda"

    def __post_init__(self) -> None:
        if self.cuda_graph not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graph={self.cuda_graph!r} is not one of None, 'partial', 'full'.")
        if self.cuda_graph is not None:
            check_size("cuda_graph_warmup_steps", self.cuda_graph_warmup_steps)
        if self.cuda_graph_backend not in CUDA_GRAPH_BACKENDS:
            raise ValueError(f"cuda_graph_backend={self.cuda_graph_backend!r} is not 'cuda' or 'eager' (the capture "
                             "bookkeeping without graphs, for CPU tests).")

    def check_with(self, gradients: GradientConfig) -> None:
        if self.cuda_graph == "full" and (gradients.use_distributed_optimizer or gradients.overlap_grad_reduce
                                          or gradients.grad_reduce_in_fp32):
            raise ValueError("cuda_graph='full' works with plain gradients: drop use_distributed_optimizer, "
                             "overlap_grad_reduce and grad_reduce_in_fp32, or use cuda_graph='partial'.")


def check_per_token_accumulation(calculate_per_token_loss: bool, accumulate_grad_batches: int) -> None:
    """Per-token losses divide by one step's token count, which accumulation over batches would split."""
    if calculate_per_token_loss and accumulate_grad_batches > 1:
        raise ValueError(
            "calculate_per_token_loss=True divides the gradients by one step's global token count, which "
            f"accumulate_grad_batches={accumulate_grad_batches} spreads over several batches: set "
            "accumulate_grad_batches=1 and a larger batch with micro_batch_size (its micro-batches accumulate "
            "exactly).")


__all__ = ["CudaGraphConfig", "GradientConfig", "ParallelConfig", "check_per_token_accumulation"]
