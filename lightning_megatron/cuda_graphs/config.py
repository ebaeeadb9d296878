"""Which CUDA graphs the step engine captures: the strategy's ``cuda_graph*`` arguments as one validated value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Union

from ..parallel.topology import check_size

if TYPE_CHECKING:
    from ..distributed.config import GradientConfig

CUDA_GRAPH_MODES = (None, "partial", "full")
CUDA_GRAPH_BACKENDS = ("cuda", "eager")


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

    def check_with(self, gradients: "GradientConfig") -> None:
        if self.cuda_graph == "full" and (gradients.use_distributed_optimizer or gradients.overlap_grad_reduce
                                          or gradients.grad_reduce_in_fp32):
            raise ValueError("cuda_graph='full' works with plain gradients: drop use_distributed_optimizer, "
                             "overlap_grad_reduce and grad_reduce_in_fp32, or use cuda_graph='partial'.")


__all__ = ["CUDA_GRAPH_BACKENDS", "CUDA_GRAPH_MODES", "CudaGraphConfig"]
