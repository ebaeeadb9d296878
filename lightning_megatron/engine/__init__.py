"""One training or evaluation step of the parallel model, without Lightning (the strategy drives it)."""

from .step import StepEngine, StepResult, activation_dtype, pipeline_roots

__all__ = ["StepEngine", "StepResult", "activation_dtype", "pipeline_roots"]
