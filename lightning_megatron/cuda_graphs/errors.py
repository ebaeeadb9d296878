"""Errors of the CUDA-graph machinery; messages name the culprit and the fix."""


class CudaGraphError(RuntimeError):
    """A graph could not be captured or replayed as asked."""


class CudaGraphShapeError(CudaGraphError, ValueError):
    """A replay got inputs of another structure, shape or dtype than the capture."""
