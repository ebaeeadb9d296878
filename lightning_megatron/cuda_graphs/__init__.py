"""CUDA graphs on PyTorch's own graph API (no transformer-engine): per-layer and full-iteration.

- :class:`PartialCudaGraphs` (``cuda_graph="partial"``, seed 003): per-layer forward/backward
  graphs captured in the pipeline schedule's order, one memory pool, static buffers bounded by
  the micro-batches in flight; scopes ``layer`` / ``attn`` / ``mlp`` / ``moe_router`` /
  ``moe_preprocess``. Layers take part through the graphable-layer protocol (:class:`GraphableLayer`,
  :class:`GraphPiece`, from ``transformer/graphable.py``), which ``TransformerLayer`` implements.
- :class:`FullCudaGraphWrapper` (``cuda_graph="full"``, seed 004): one graph for the whole
  forward-backward of a training step, one for validation.

Both are Lightning-free; ``MegatronStrategy(cuda_graph=...)`` drives them.
"""

from ..transformer.graphable import GraphableLayer, GraphPiece
from .config import CudaGraphConfig
from .backend import BACKENDS, weak_alias
from .errors import CudaGraphError, CudaGraphShapeError
from .full import FullCudaGraphWrapper
from .partial import PartialCudaGraphs, layer_chunks
from .plan import BufferPlan, GraphStep, max_in_flight, order_steps, static_buffer_plan
from .scopes import SCOPES, normalize_scope

__all__ = [
    "BACKENDS", "BufferPlan", "CudaGraphConfig", "CudaGraphError", "CudaGraphShapeError", "FullCudaGraphWrapper", "GraphPiece",
    "GraphStep", "GraphableLayer", "PartialCudaGraphs", "SCOPES", "layer_chunks", "max_in_flight",
    "normalize_scope", "order_steps", "static_buffer_plan", "weak_alias",
]
