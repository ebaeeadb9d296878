"""torchmetrics objects under pipeline parallelism: the other stages' copies follow the last stage's.

Only the last stage runs the user's ``*_step``, so only its metrics see the data. After each step the
states of the metrics it updated go to the same metrics (same attribute path) on the other stages of
its pipeline: tensor states as one device tensor per dtype over the pp group (no host sync), list states'
new items host to host. Every rank's metric then logs, computes and syncs over data parallelism as the
last stage's does: the epoch value of a macro average or a weighted mean is one process's, and a
``compute()`` in an epoch-end hook reads the same state on every stage.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..parallel import ParallelState
from ..engine.logs import to_host

# per metric, what the other stages already hold: (update count, {tensor state: the tensor sent},
# {list state: (items sent, the last item sent)}); the objects themselves are kept, so a reset (new tensors,
# cleared lists) followed by as many updates as before still reads as a change
_SENT = "_states_sent_to_other_stages"

# what the last stage tells the others about one metric: path, update count, tensor states as
# (name, shape, dtype) with "_forward_cache" among them when it is a tensor, list states as (name, first item sent)
Change = Tuple[str, int, List[Tuple[str, tuple, torch.dtype]], List[Tuple[str, int]]]


def named_metrics(module: nn.Module) -> List[Tuple[str, Any]]:
    """The torchmetrics objects of ``module`` by attribute path (found once: the model is built)."""
    try:
        from torchmetrics import Metric
    except ImportError:   # no torchmetrics: nothing can be logged as a metric object
        return []
    return [(path, m) for path, m in module.named_modules() if isinstance(m, Metric)]


def pending_changes(metrics: List[Tuple[str, Any]]) -> List[Change]:
    """On the last stage: the metrics updated (or reset) since their states were last sent, and their layout."""
    changes: List[Change] = []
    for path, metric in metrics:
        count, sent_tensors, sent_lists = getattr(metric, _SENT, (0, {}, {}))
        tensors, lists, changed = [], [], metric._update_count != count
        for name in metric._defaults:
            value = getattr(metric, name)
            if isinstance(value, torch.Tensor):
                tensors.append((name, tuple(value.shape), value.dtype))
                changed |= sent_tensors.get(name) is not value
            else:
                length, last = sent_lists.get(name, (0, None))
                kept = length <= len(value) and (length == 0 or value[length - 1] is last)
                lists.append((name, length if kept else 0))   # not kept: reset since, send every item again
                changed |= not kept or len(value) != length
        if not changed:
            continue
        cache = metric._forward_cache
        if isinstance(cache, torch.Tensor):
            tensors.append(("_forward_cache", tuple(cache.shape), cache.dtype))
        changes.append((path, metric._update_count, tensors, lists))
    return changes


def send_metric_states(by_path: Dict[str, Any], changes: List[Change], state: ParallelState) -> None:
    """Make every stage's metrics named in ``changes`` (``by_path``: path -> metric) hold the last stage's
    states (a collective over the pipeline: call it on every stage with the same ``changes``)."""
    if not changes:
        return
    src = state.ranks("pp")[-1]
    mine = state.rank == src
    tensors: Dict[torch.dtype, List[Tuple[Any, str, torch.Tensor]]] = {}
    for path, _, layout, _ in changes:
        metric = by_path[path]
        for name, shape, dtype in layout:
            value = getattr(metric, name) if mine else torch.empty(shape, dtype=dtype, device=metric.device)
            tensors.setdefault(dtype, []).append((metric, name, value))
    for dtype, entries in tensors.items():
        values = [value.detach() for _, _, value in entries]
        flat = _flatten_dense_tensors(values)
        dist.broadcast(flat, src=src, group=state.pp_group)
        if not mine:
            for (metric, name, _), synced in zip(entries, _unflatten_dense_tensors(flat, values)):
                setattr(metric, name, synced.clone())
    items = [[getattr(by_path[path], name)[first:] for name, first in lists] for path, _, _, lists in changes] \
        if mine else None
    if any(lists for _, _, _, lists in changes):
        box = [to_host(items)]
        dist.broadcast_object_list(box, src=src, group=state.pp_host_group)
        items = box[0]
    for index, (path, count, layout, lists) in enumerate(changes):
        metric = by_path[path]
        sent_lists = {}
        for position, (name, first) in enumerate(lists):
            current = getattr(metric, name)
            if not mine:
                assert items is not None   # the list states' new items, broadcast above
                del current[first:]
                current.extend(item.to(metric.device) for item in items[index][position])
            sent_lists[name] = (len(current), current[-1] if current else None)
        if not mine:
            metric._update_count = count
            metric._computed = None
            if not any(name == "_forward_cache" for name, _, _ in layout):
                metric._forward_cache = None
        sent_tensors = {name: getattr(metric, name) for name, _, _ in layout if name != "_forward_cache"}
        setattr(metric, _SENT, (count, sent_tensors, sent_lists))


def sync_metrics_over_data_parallel(model: nn.Module, state: ParallelState) -> None:
    """torchmetrics objects sync over data-parallel replicas only: tp/cp/pp peers saw the same samples.

    A metric's own ``process_group`` is kept; one set here by an earlier run (each ``fit``/``validate``/``test``
    builds new process groups and destroys the old) is replaced by this run's."""
    from torchmetrics import Metric

    for module in model.modules():
        if isinstance(module, Metric) and (module.process_group is None or getattr(module, _OURS, False)):
            module.process_group = state.dp_cp_group
            setattr(module, _OURS, True)


_OURS = "_data_parallel_group_set_by_megatron"
