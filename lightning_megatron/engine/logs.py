"""What a step's loss function logged, combined into what one process would have logged for the batch.

The loss function (the last stage's call per micro-batch) returns its logged values as
``{name: (scalar tensor, op)}`` with ``op`` one of :data:`REDUCE_OPS`. The engine combines them over
the micro-batches (``"mean"`` weighted by their samples), hands them from the last pipeline stage to
every stage (names host to host, values as one device tensor: no host sync), and combines them over
the context-parallel ranks, each of which logged from its share of the sequences. Values stay on the
device. Nothing here knows who logs (Lightning's ``self.log`` is captured in the adapter).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist

from ..parallel import ParallelState

REDUCE_OPS = ("mean", "sum", "max", "min")
Logged = Dict[str, Tuple[torch.Tensor, str]]
LogError = Tuple[str, str]   # (exception type name, message): raised on every rank after the step


def check_logged(logs: Mapping[str, Any]) -> Logged:
    """``logs`` as ``{name: (detached float32 scalar, op)}``, or a ``ValueError``/``TypeError`` naming the entry."""
    out: Logged = {}
    for name, entry in logs.items():
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError(f"logged value {name!r} must be a (value, op) pair, got {type(entry).__name__}.")
        value, op = entry
        if op not in REDUCE_OPS:
            raise ValueError(f"logged value {name!r}: op={op!r} is not one of {', '.join(map(repr, REDUCE_OPS))}.")
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value))
        if value.numel() != 1:
            raise ValueError(f"logged value {name!r} has shape {tuple(value.shape)}: a step's logged values are "
                             "combined over micro-batches and pipeline stages, so each must be one number.")
        out[name] = (value.detach().float().reshape(()), op)
    return out


def combine_microbatches(logged: Sequence[Logged], weights: Sequence[float]) -> Logged:
    """Each name's value for the whole batch from the micro-batches that logged it: ``"sum"``, ``"max"``,
    ``"min"`` over them, ``"mean"`` weighted by ``weights`` (their samples), so a mean over samples comes out
    as one process's batch value."""
    out: Logged = {}
    for name in dict.fromkeys(n for logs in logged for n in logs):
        entries = [(logs[name], w) for logs, w in zip(logged, weights) if name in logs]
        op = entries[0][0][1]
        values = torch.stack([value for (value, _), _ in entries])
        used = [w for _, w in entries]
        if op == "mean":
            value = values.mean() if len(set(used)) == 1 else (values * values.new_tensor(used)).sum() / sum(used)
        elif op == "sum":
            value = values.sum()
        else:
            value = values.amax() if op == "max" else values.amin()
        out[name] = (value, op)
    return out


def combine_over(logs: Logged, group: Any, size: int) -> Logged:
    """Each value combined over ``group``'s ranks by its op (a collective: the same names on every rank), as
    if one rank had logged from all their equal shares. One all-reduce per op, on the device."""
    by_op: Dict[str, List[str]] = {}
    for name, (_, op) in logs.items():
        by_op.setdefault(op, []).append(name)
    out = dict(logs)
    reduce_ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                  "min": dist.ReduceOp.MIN}
    for op, names in sorted(by_op.items()):
        values = torch.stack([logs[name][0] for name in names])
        dist.all_reduce(values, op=reduce_ops[op], group=group)
        if op == "mean":
            values = values / size
        for i, name in enumerate(names):
            out[name] = (values[i], op)
    return out


def broadcast_from_last_stage(logs: Logged, state: ParallelState, device: torch.device,
                              error: Optional[LogError] = None, host: Any = None
                              ) -> Tuple[Logged, Optional[LogError], Any]:
    """The last stage's ``logs``, the error its loss function's logs raised and ``host`` (Python objects and
    CPU tensors) on every stage: names, ops, error and ``host`` host to host (gloo), the values as one device
    tensor over the pp group."""
    if state.pp_size == 1:
        return logs, error, host
    src = state.ranks("pp")[-1]
    box: List[Any] = [([(name, op) for name, (_, op) in logs.items()], error, to_host(host))
                      if state.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=state.pp_host_group)
    layout, error, host = box[0]
    if not layout:
        return {}, error, host
    if state.rank == src:
        values = torch.stack([logs[name][0].to(device, torch.float32) for name, _ in layout])
    else:
        values = torch.empty(len(layout), dtype=torch.float32, device=device)
    dist.broadcast(values, src=src, group=state.pp_group)
    return {name: (values[i], op) for i, (name, op) in enumerate(layout)}, error, host


def broadcast_object_from_last_stage(obj: Any, state: ParallelState) -> Any:
    """``obj`` (Python objects and CPU tensors) as the last pipeline stage holds it, on every stage."""
    if state.pp_size == 1:
        return obj
    box = [to_host(obj)]
    dist.broadcast_object_list(box, src=state.ranks("pp")[-1], group=state.pp_host_group)
    return box[0]


def raise_log_error(error: Optional[LogError]) -> None:
    """Raise what a step's logging could not record (after the step's collectives, on every rank)."""
    if error is not None:
        raise {"TypeError": TypeError}.get(error[0], ValueError)(error[1])


def to_host(obj: Any) -> Any:
    """Tensors (nested in mappings, lists, tuples and named tuples, whose types are kept) detached onto the CPU:
    before pickling them for another rank, or handing predictions back."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        items = {k: to_host(v) for k, v in obj.items()}
        try:
            return cast(Any, type(obj))(items)
        except TypeError:   # a mapping type not built from a dict (e.g. a defaultdict): a plain dict
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_host(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj
