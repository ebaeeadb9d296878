"""The user's ``*_step`` as the step engine calls it on one micro-batch, with Lightning's hooks around it.

The engine knows nothing of Lightning: on the last pipeline stage it calls ``last_stage(microbatch)``
and backpropagates the :class:`StageOutput` that returns. Here that call becomes the user's
``training_step`` (or evaluation hook) with ``self.log`` captured into the output's ``logs``, plus what
Lightning does around a backward: the loss divided by ``accumulate_grad_batches``,
``on_before_backward`` (callbacks, then the module), then the AMP scaler's scaling. After the step,
:func:`finish_step` replays the logs on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, cast

import torch

from ..engine.logs import broadcast_object_from_last_stage, raise_log_error
from ..engine.step import StageOutput, StepResult
from ..parallel import ParallelState
from .log_capture import LogCapture, replay
from .metric_sync import pending_changes, send_metric_states


def call_hooks(trainer: Any, name: str, *args: Any) -> None:
    """Lightning's hook ``name`` on every callback, then on the LightningModule (Lightning's order)."""
    from lightning.pytorch.trainer import call

    call._call_callback_hooks(trainer, name, *args)
    call._call_lightning_module_hook(trainer, name, *args)


def check_automatic_optimization(module: Any) -> None:
    """Refuse manual optimization: the pipeline schedule runs every backward itself, after the user's
    ``training_step`` returns, so a ``manual_backward`` + ``opt.step()`` inside it would step on gradients
    that do not exist yet (and, under pipeline parallelism, on the last stage only)."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} sets automatic_optimization = False, which the megatron strategy cannot run: "
            "its pipeline schedule runs forward and backward of every micro-batch itself, so manual_backward and "
            "optimizer.step() inside training_step would step before this batch's gradients exist. Return the "
            "loss from training_step with automatic_optimization = True (clip with Trainer(gradient_clip_val=...), "
            "accumulate with Trainer(accumulate_grad_batches=...), one optimizer with parameter groups for "
            "different settings).")


def check_model_kept(module: Any, before: set) -> None:
    """Refuse a ``configure_model`` that replaced parameters an earlier run of this module built (``before``:
    their ids): Lightning calls the hook at every ``fit``/``validate``/``test``/``predict``, and a rebuilt model
    would silently evaluate or train fresh weights instead of the trained ones."""
    if before and before - {id(p) for p in module.parameters()}:
        raise RuntimeError(
            f"{type(module).__name__}.configure_model built new parameters in place of the ones an earlier "
            "trainer.fit/validate/test/predict of this module used, so their trained values would be lost: "
            "Lightning calls configure_model at every entry point, so return early when the model exists "
            "(e.g. `if hasattr(self, \"model\"): return` at the top of configure_model).")


class Metrics:
    """The module's torchmetrics objects by attribute path (found once: the model is built), kept equal over
    the pipeline's stages (``metric_sync``)."""

    def __init__(self, module: Any, state: ParallelState) -> None:
        from .metric_sync import named_metrics

        self.state = state
        self.by_path = dict(named_metrics(module)) if state.pp_size > 1 else {}
        self.paths = {id(metric): path for path, metric in self.by_path.items()}

    def capture(self, module: Any, passthrough: bool) -> LogCapture:
        """A capture of one step's ``self.log`` calls (torchmetrics objects logged for real unless
        ``passthrough`` is off: inside a CUDA graph they log their batch value)."""
        return LogCapture(module, passthrough_metrics=passthrough,
                          metric_paths=self.paths if self.state.pp_size > 1 else None)

    def sync(self, metric_logs: Dict[str, Tuple[str, tuple, dict]]) -> Dict[str, Tuple[Any, tuple, dict]]:
        """After a step under pipeline parallelism: the last stage's metric states on every stage (host to host
        for which changed; a collective over pp); this stage's copies of the metrics the last stage logged."""
        if not self.by_path:
            return {}
        last = self.state.is_pipeline_last_stage(ignore_virtual=True)
        changes = broadcast_object_from_last_stage(pending_changes(list(self.by_path.items())) if last else None,
                                                   self.state)
        send_metric_states(self.by_path, changes, self.state)
        if last:   # the last stage logged its metrics during the step
            return {}
        return {name: (self.by_path[path], args, kwargs) for name, (path, args, kwargs) in metric_logs.items()}


class LastStageCall:
    """The user's hook on one micro-batch of the last stage, its ``self.log`` calls captured (one object per
    step). ``extras()`` is what the other stages receive after the step."""

    def __init__(self, module: Any, capture: LogCapture) -> None:
        self.module, self.capture = module, capture
        self.outputs: List[dict] = []

    def extras(self) -> Dict[str, Any]:
        outputs, self.outputs = self.outputs, []
        return {"logging": self.capture.host_state(), "outputs": batch_output(outputs) if outputs else None}


class EvalLastStage(LastStageCall):
    """``validation_step``/``test_step``/``predict_step`` on one micro-batch."""

    def __init__(self, module: Any, capture: LogCapture, hook: str, step_args: tuple, step_kwargs: dict) -> None:
        super().__init__(module, capture)
        self.hook, self.step_args, self.step_kwargs = hook, step_args, step_kwargs

    def __call__(self, microbatch: Any) -> StageOutput:
        with self.capture.microbatch() as logs:
            out = getattr(self.module, self.hook)(microbatch, *self.step_args, **self.step_kwargs)
        return StageOutput(output=out, logs=logs)


class TrainingLastStage(LastStageCall):
    """What the last stage runs per micro-batch: the loss to backpropagate, the loss to report[, the token
    count] and the logs; the other entries of a dict ``training_step`` returns are kept per micro-batch and
    joined in ``extras()["outputs"]`` (what Lightning hands ``on_train_batch_end`` as ``outputs`` besides
    ``"loss"``). ``step_args``: ``training_step``'s arguments after the batch (the batch index)."""

    def __init__(self, module: Any, capture: LogCapture, step_args: tuple, step_kwargs: dict, scaler: Optional[Any],
                 per_token: bool) -> None:
        super().__init__(module, capture)
        self.step_args, self.step_kwargs = step_args, step_kwargs
        self.scaler, self.per_token = scaler, per_token
        self.accumulate = module.trainer.accumulate_grad_batches

    def __call__(self, microbatch: Any) -> StageOutput:
        with self.capture.microbatch() as logs:
            out = self.module.training_step(microbatch, *self.step_args, **self.step_kwargs)
        loss, num_tokens = extract_loss(out, self.per_token)
        # "num_tokens" of per-token losses comes back as the global count (StepResult): no host transfer for it
        extra = {k: v for k, v in out.items() if k != "loss" and not (self.per_token and k == "num_tokens")} \
            if isinstance(out, Mapping) else {}
        if extra:
            self.outputs.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in extra.items()})
        backward = loss / self.accumulate
        call_hooks(self.module.trainer, "on_before_backward", backward)
        scaled = self.scaler.scale(backward) if self.scaler is not None else backward
        return StageOutput(loss=scaled, report=loss.detach(), num_tokens=num_tokens, logs=logs)


def finish_step(module: Any, result: StepResult, metrics: Metrics, device: torch.device) -> Any:
    """On every rank after a step: raise what the step's logging could not record, bring the metrics of the
    other stages up to date, log the step's combined values for real; returns the joined other outputs
    (training) of the last stage."""
    host = result.extras or {"logging": {"meta": {}, "metric_logs": {}, "error": None}, "outputs": None}
    raise_log_error(host["logging"]["error"])
    copies = metrics.sync(host["logging"]["metric_logs"])
    replay(module, result.logs, host["logging"]["meta"], copies, device)
    return host["outputs"]


def training_outputs(extras: Any, result: StepResult) -> Dict[str, Any]:
    """What ``on_train_batch_end`` gets: the last stage's other outputs, the loss, and the global batch's token
    count as one process counts it (per-token losses)."""
    outputs = dict(extras or {}, loss=result.loss)
    if result.num_tokens is not None:
        outputs["num_tokens"] = result.num_tokens
    return outputs


def extract_loss(out: Any, per_token: bool) -> Tuple[torch.Tensor, Optional[Any]]:
    """``(loss, token count)`` from what ``training_step`` returned (the count is ``None`` for mean losses)."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError("training_step must return the loss (a scalar tensor) or a dict with a 'loss' key under "
                        f"the megatron strategy, got {type(out).__name__}.")
    if not per_token:
        return loss, None
    if not isinstance(out, Mapping) or out.get("num_tokens") is None:
        raise TypeError("with calculate_per_token_loss=True, training_step must return {'loss': <sum of the token "
                        "losses>, 'num_tokens': <how many tokens were summed>}; got no 'num_tokens'. Return both, or "
                        "set calculate_per_token_loss=False and return the mean.")
    return loss, out["num_tokens"]


def batch_output(outputs: Optional[List[Any]]) -> Any:
    """An evaluation step's per-micro-batch outputs as one batch's output (``None`` when it returned none)."""
    if outputs is None:
        return None
    return outputs[0] if len(outputs) == 1 else _concat(outputs)


def _concat(outputs: List[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if first.dim() else torch.stack(outputs).mean()
    if isinstance(first, Mapping):
        return cast(Any, type(first))({k: _concat([o[k] for o in outputs]) for k in first})
    if isinstance(first, (str, bool, int, float)) and all(o == first for o in outputs):
        return first   # the same plain value from every micro-batch (as equal tensor scalars average to it)
    return outputs


def check_per_token_accumulation(calculate_per_token_loss: bool, accumulate_grad_batches: int) -> None:
    """Per-token losses divide by one step's token count, which accumulation over batches would split."""
    if calculate_per_token_loss and accumulate_grad_batches > 1:
        raise ValueError(
            "calculate_per_token_loss=True divides the gradients by one step's global token count, which "
            f"accumulate_grad_batches={accumulate_grad_batches} spreads over several batches: set "
            "accumulate_grad_batches=1 and a larger batch with micro_batch_size (its micro-batches accumulate "
            "exactly).")
