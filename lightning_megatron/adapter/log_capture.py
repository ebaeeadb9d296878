"""Lightning's ``self.log`` inside the micro-batches of one step: captured as the engine's logged values,
replayed once on every rank.

Under pipeline parallelism ``training_step`` runs only on the last stage, once per micro-batch. Its
``self.log`` calls become the ``{name: (value, op)}`` the last stage's call returns to the engine
(``op`` from ``reduce_fx``), which combines them over micro-batches, stages and cp ranks; the
Lightning arguments of each call (``prog_bar``, ``sync_dist``, ...) travel beside them as host
metadata. After the step every rank logs the combined values for real with those arguments, so rank
0's progress bar and loggers see them and ``sync_dist=True`` is entered by every rank (never a hang).
torchmetrics objects are logged for real on the last stage at once (their own state gives the exact
epoch value); the other stages log their copies, whose states ``metric_sync`` keeps equal.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from ..engine.logs import LogError, Logged

Meta = Dict[str, Tuple[tuple, dict]]   # name -> the log call's other arguments


class LogCapture:
    """One step's ``self.log`` calls on the last stage. ``passthrough_metrics``: log torchmetrics objects for
    real at once; otherwise (inside a CUDA graph capture) log their batch value. Under pipeline parallelism
    ``metric_paths`` (``id(metric)`` -> attribute path) names each logged metric, so the other stages log
    their own copy.

    A call that cannot be recorded (not a scalar, an unknown ``reduce_fx``) is not raised inside the step,
    where only the last stage would see it while the others wait: ``error`` keeps the first one, raised on
    every rank after the step."""

    def __init__(self, module: Any, passthrough_metrics: bool, metric_paths: Optional[Dict[int, str]] = None) -> None:
        self.module = module
        self.passthrough_metrics = passthrough_metrics
        self.metric_paths = metric_paths
        self.meta: Meta = {}
        self.metric_logs: Dict[str, Tuple[str, tuple, dict]] = {}
        self.error: Optional[LogError] = None

    @contextlib.contextmanager
    def microbatch(self) -> Iterator[Logged]:
        """Record the module's ``log``/``log_dict`` calls made inside this block into the yielded dict."""
        records: Logged = {}

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if self.passthrough_metrics and _is_metric(value):
                if self.metric_paths is not None:
                    if id(value) not in self.metric_paths:
                        self.error = self.error or ("ValueError", _UNNAMED_METRIC.format(name=name))
                        return
                    self.metric_logs[name] = (self.metric_paths[id(value)], args, kwargs)
                type(self.module).log(self.module, name, value, *args, **kwargs)
                return
            try:
                records[name] = (_as_value(name, value), reduce_op(args, kwargs))
                self.meta.setdefault(name, (args, kwargs))
            except (TypeError, ValueError) as err:
                self.error = self.error or (type(err).__name__, str(err))

        def log_dict(dictionary: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
            for name, value in dictionary.items():
                log(name, value, *args, **kwargs)

        self.module.log, self.module.log_dict = log, log_dict   # instance attributes shadow the methods
        try:
            yield records
        finally:
            del self.module.log
            del self.module.log_dict

    def host_state(self) -> Dict[str, Any]:
        """What the other stages need to replay the step's logs (host objects)."""
        return {"meta": self.meta, "metric_logs": self.metric_logs, "error": self.error}


_UNNAMED_METRIC = ("self.log({name!r}, <torchmetrics metric>): under pipeline parallelism only the last stage runs "
                   "the step, and every stage logs its own copy of the metric, found by its attribute path: make the "
                   "metric an attribute of the LightningModule (or of a module, MetricCollection or ModuleDict in it).")

_REDUCE_FX = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
              torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.amax: "max", torch.min: "min",
              torch.amin: "min"}


def reduce_op(args: tuple, kwargs: dict) -> str:
    """The engine's op for the ``reduce_fx`` of a ``self.log(name, value, prog_bar, logger, on_step, on_epoch,
    reduce_fx, ...)`` call."""
    reduce_fx = kwargs.get("reduce_fx", args[4] if len(args) > 4 else "mean")
    try:
        return _REDUCE_FX[reduce_fx]
    except (KeyError, TypeError):
        raise ValueError(f"self.log(..., reduce_fx={reduce_fx!r}): the megatron strategy combines the values of a "
                         "step's micro-batches by reduce_fx, which must be 'mean', 'sum', 'max' or 'min' (or "
                         "torch.mean/sum/max/min), as Lightning's own logging requires.") from None


def _is_metric(value: Any) -> bool:
    from torchmetrics import Metric

    return isinstance(value, Metric)


def _as_value(name: str, value: Any) -> torch.Tensor:
    """A detached float32 scalar tensor, left on its device (reading it would sync every micro-batch)."""
    if _is_metric(value):
        # the metric object lives on the last stage only: log the value it computed for this batch
        value = value._forward_cache
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}: the megatron "
                             "strategy combines a step's logged values over its micro-batches and pipeline "
                             "stages, so each must be a number or a one-element tensor.")
        return value.detach().float().reshape(())
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value))
    raise TypeError(f"self.log({name!r}, ...) got a {type(value).__name__}: the megatron strategy combines a "
                    "step's logged values over its micro-batches and pipeline stages, so each must be a number or "
                    "a one-element tensor.")


class _DataParallelGroup:
    """Stands for the data-parallel group as ``sync_dist_group`` (the step combined the values over cp
    already); the strategy's ``reduce`` puts in the group of the current run. Lightning compares every
    ``self.log`` call with the first one of that name for the Trainer's whole life, and ``setup_environment``
    builds new process groups for each ``fit``/``validate``/``test``: passing the group itself made the second
    run fail ("twice ... with different arguments"). One object, the same in every run."""

    def __repr__(self) -> str:
        return "DATA_PARALLEL_GROUP"

    def __reduce__(self) -> str:
        return "DATA_PARALLEL_GROUP"   # pickles as this module's one instance


DATA_PARALLEL_GROUP = _DataParallelGroup()


def replay(module: Any, logs: Logged, meta: Meta, metric_copies: Dict[str, Tuple[Any, tuple, dict]],
           device: torch.device) -> None:
    """Log the step's combined ``logs`` for real with their Lightning arguments (``meta``), and
    ``metric_copies`` (this stage's copies of metrics the last stage logged); ``sync_dist`` reduces over the
    data-parallel replicas only (``DATA_PARALLEL_GROUP``, which the strategy's ``reduce`` resolves)."""
    for name, (metric, args, kwargs) in metric_copies.items():
        module.log(name, metric, *args, **kwargs)
    for name, (value, _) in logs.items():
        args, kwargs = meta[name]
        kwargs = dict(kwargs)
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs["sync_dist_group"] = DATA_PARALLEL_GROUP
        module.log(name, value.to(device), *args, **kwargs)
