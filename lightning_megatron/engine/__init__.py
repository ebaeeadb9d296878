"""One training or evaluation step of the parallel model, without Lightning: the step engine (micro-batches,
schedule, loss and logs), the step protocol around it (``TrainStep``: zero, no-sync, run, finalize, scale,
clip, post-optimizer obligations) and micro-batching."""

from .logs import REDUCE_OPS, Logged
from .step import StageOutput, StepEngine, StepResult, activation_dtype, pipeline_roots
from .train_step import TrainStep

__all__ = ["REDUCE_OPS", "Logged", "StageOutput", "StepEngine", "StepResult", "TrainStep", "activation_dtype",
           "pipeline_roots"]
