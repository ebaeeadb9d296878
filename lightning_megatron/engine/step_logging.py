"""What a LightningModule logs inside the micro-batches of one step, gathered and replayed once.

Under pipeline parallelism ``training_step`` runs only on the last stage, once per micro-batch.
``self.log`` calls are recorded there, combined over micro-batches by their ``reduce_fx``, broadcast to every stage and
then logged for real on every rank with the same arguments, so rank 0's progress bar and
loggers see them and ``sync_dist=True`` is entered by every rank (never a hang).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..parallel import ParallelState

Record = Tuple[Any, tuple, dict]


class StepLogCapture:
    """``passthrough_metrics``: log torchmetrics objects for real at once (the metric's own state and sync
    give the exact epoch value); otherwise (inside a CUDA graph capture) log their batch value. Under
    pipeline parallelism ``metric_paths`` (``id(metric)`` -> attribute path) names each logged metric in
    ``metric_logs``, so the other stages log their own copy (whose states ``metric_sync`` keeps equal).

    A ``log`` call the strategy cannot record (not a scalar, an unknown ``reduce_fx``) is not raised inside
    the step, where only the last pipeline stage would see it while the others wait for it: ``error`` keeps
    the first one, which the engine raises on every rank after the step (``raise_log_error``)."""

    def __init__(self, module: Any, passthrough_metrics: bool, metric_paths: Optional[Dict[int, str]] = None) -> None:
        self.module = module
        self.passthrough_metrics = passthrough_metrics
        self.metric_paths = metric_paths
        self.metric_logs: Dict[str, Tuple[str, tuple, dict]] = {}
        self.microbatches: List[Dict[str, Record]] = []
        self.weights: List[float] = []
        self.error: Optional[Tuple[str, str]] = None   # (exception type name, message)

    @contextlib.contextmanager
    def microbatch(self, weight: float = 1.0) -> Iterator[None]:
        """Record the module's ``log``/``log_dict`` calls made inside this block. ``weight``: the
        micro-batch's samples, so a smaller last micro-batch counts for what it holds."""
        records: Dict[str, Record] = {}
        self.microbatches.append(records)
        self.weights.append(float(weight))

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
                _reduce_fx(args, kwargs)
                records[name] = (_as_value(name, value), args, kwargs)
            except (TypeError, ValueError) as err:
                self.error = self.error or (type(err).__name__, str(err))

        def log_dict(dictionary: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
            for name, value in dictionary.items():
                log(name, value, *args, **kwargs)

        self.module.log, self.module.log_dict = log, log_dict   # instance attributes shadow the methods
        try:
            yield
        finally:
            del self.module.log
            del self.module.log_dict

    def combined(self) -> Dict[str, Record]:
        """Each logged name's value for the whole batch, from the micro-batches that logged it, by its
        ``reduce_fx`` (what Lightning then applies over the epoch's steps): ``"sum"``, ``"max"``, ``"min"``
        over the micro-batches, ``"mean"`` (the default) weighted by their samples, so a sum, maximum or
        mean over samples comes out as one process's batch value. Values stay on the device (no sync)."""
        out: Dict[str, Record] = {}
        names = [n for records in self.microbatches for n in records]
        for name in dict.fromkeys(names):
            logged = [(records[name], w) for records, w in zip(self.microbatches, self.weights) if name in records]
            _, args, kwargs = logged[0][0]
            values = torch.stack([record[0] for record, _ in logged])
            weights = [w for _, w in logged]
            reduce = _reduce_fx(args, kwargs)
            if reduce == "mean":
                value = values.mean() if len(set(weights)) == 1 else \
                    (values * values.new_tensor(weights)).sum() / sum(weights)
            else:
                value = {"sum": values.sum, "max": values.amax, "min": values.amin}[reduce]()
            out[name] = (value, args, kwargs)
        return out


_UNNAMED_METRIC = ("self.log({name!r}, <torchmetrics metric>): under pipeline parallelism only the last stage runs "
                   "the step, and every stage logs its own copy of the metric, found by its attribute path: make the "
                   "metric an attribute of the LightningModule (or of a module, MetricCollection or ModuleDict in it).")

_REDUCE_FX = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
              torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.amax: "max", torch.min: "min",
              torch.amin: "min"}


def _reduce_fx(args: tuple, kwargs: dict) -> str:
    """The ``reduce_fx`` of a ``self.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, ...)`` call."""
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
    if isinstance(value, numbers.Number):
        return torch.tensor(float(value))
    raise TypeError(f"self.log({name!r}, ...) got a {type(value).__name__}: the megatron strategy combines a "
                    "step's logged values over its micro-batches and pipeline stages, so each must be a number or "
                    "a one-element tensor.")


def combine_logs_over(logs: Dict[str, Record], group: Any, size: int) -> Dict[str, Record]:
    """Each logged value combined over ``group``'s ranks by its ``reduce_fx`` (a collective: the same names on
    every rank of the group), as if one rank had logged from all their shares; metric objects are left alone.
    One all-reduce per kind of reduction, on the device (no host sync)."""
    by_op: Dict[str, List[str]] = {}
    for name, (value, args, kwargs) in logs.items():
        if isinstance(value, torch.Tensor):
            by_op.setdefault(_reduce_fx(args, kwargs), []).append(name)
    out = dict(logs)
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for reduce, names in sorted(by_op.items()):
        values = torch.stack([logs[name][0].float() for name in names])
        dist.all_reduce(values, op=ops[reduce], group=group)
        if reduce == "mean":   # the shares are equal (each rank holds 2 of the 2·cp chunks of every sequence)
            values = values / size
        for i, name in enumerate(names):
            out[name] = (values[i], logs[name][1], logs[name][2])
    return out


def raise_log_error(error: Optional[Tuple[str, str]]) -> None:
    """Raise what a step's ``log`` call could not record (the same on every rank it reached)."""
    if error is not None:
        raise {"TypeError": TypeError}.get(error[0], ValueError)(error[1])


def broadcast_from_last_stage(obj: Any, state: ParallelState) -> Any:
    """``obj`` (Python objects and CPU tensors) as the last pipeline stage holds it, on every stage (host
    to host over the pp group's gloo twin)."""
    if state.pp_size == 1:
        return obj
    box = [to_host(obj)]
    dist.broadcast_object_list(box, src=state.ranks("pp")[-1], group=state.pp_host_group)
    return box[0]


def broadcast_logs_from_last_stage(logs: Dict[str, Record], state: ParallelState, device: torch.device,
                                   error: Optional[Tuple[str, str]] = None, extra: Any = None
                                   ) -> Tuple[Dict[str, Record], Optional[Tuple[str, str]], Any]:
    """The last stage's combined records, the error of a ``log`` call it could not record and ``extra`` (host
    objects) on every stage without a host sync: names, logging arguments, error and ``extra`` go host to host
    (gloo), the values as one device tensor over the pp group."""
    if state.pp_size == 1:
        return logs, error, extra
    src = state.ranks("pp")[-1]
    box = [([(name, args, kwargs) for name, (_, args, kwargs) in logs.items()], error, extra) if state.rank == src
           else None]
    dist.broadcast_object_list(box, src=src, group=state.pp_host_group)
    layout, error, extra = box[0]
    if not layout:
        return {}, error, extra
    if state.rank == src:
        values = torch.stack([logs[name][0].to(device, torch.float32) for name, _, _ in layout])
    else:
        values = torch.empty(len(layout), dtype=torch.float32, device=device)
    dist.broadcast(values, src=src, group=state.pp_group)
    return {name: (values[i], args, kwargs) for i, (name, args, kwargs) in enumerate(layout)}, error, extra


class _DataParallelGroup:
    """Stands for the data-parallel group as ``sync_dist_group`` (the step combined the values over cp
    already); the strategy's ``reduce`` puts in the group of the current run. Lightning compares every ``self.log`` call with the first one of that name
    for the Trainer's whole life, and ``setup_environment`` builds new process groups for each
    ``fit``/``validate``/``test``: passing the group itself made the second run fail ("twice ... with
    different arguments"). One object, the same in every run."""

    def __repr__(self) -> str:
        return "DATA_PARALLEL_GROUP"

    def __reduce__(self) -> str:
        return "DATA_PARALLEL_GROUP"   # pickles as this module's one instance


DATA_PARALLEL_GROUP = _DataParallelGroup()


def replay(module: Any, records: Dict[str, Record], device: torch.device) -> None:
    """Log ``records`` for real; ``sync_dist`` reduces over the data-parallel replicas only
    (``DATA_PARALLEL_GROUP``, which the strategy's ``reduce`` resolves)."""
    for name, (value, args, kwargs) in records.items():
        if _is_metric(value):   # another stage's copy of a metric the last stage logged
            module.log(name, value, *args, **kwargs)
            continue
        kwargs = dict(kwargs)
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs["sync_dist_group"] = DATA_PARALLEL_GROUP
        module.log(name, torch.as_tensor(value).to(device), *args, **kwargs)


def to_host(obj: Any) -> Any:
    """Tensors (nested in mappings, lists, tuples and named tuples, whose types are kept) detached onto the CPU:
    before pickling them for another rank, or handing predictions back."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        items = {k: to_host(v) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:   # a mapping type not built from a dict (e.g. a defaultdict): a plain dict
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_host(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj
