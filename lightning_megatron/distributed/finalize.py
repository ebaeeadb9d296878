"""After the last backward of a step: make every gradient what one process would have computed.

1. sequence-parallel parameters (norms, row-parallel biases): sum over tp, each rank saw a slice
   of the sequence;
2. tied word embeddings on the first and last stage: sum over the embedding group;
3. data parallelism: sum over the dense ``dp-cp`` group, or over ``edp`` for expert parameters
   (``param.expert_parallel = True``), one coalesced all-reduce per (group, dtype), divided by
   the dp·cp size. Every rank's loss is the mean over its own tokens, so averaging over dp·cp is
   the mean over the global batch. An expert's ``edp`` group also holds the ranks that routed
   other shares of the same tokens (the MoE layer splits tokens over tp): their gradients add up,
   so the divisor is dp·cp there too, not the group size.

With gradient buffers (``DataParallelGrads``) the order changes, since buckets may already be in
flight: the data-parallel reduction is finished first (the tied embedding's bucket waits for
step 2), then step 1 runs on ``main_grad``. Sums commute, so the result is the same; under a
reduce-scatter only each rank's shard is valid, and tp peers' buffers line up element for
element (checked by the strategy), so summing whole ``main_grad`` tensors over tp keeps every
shard right.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..parallel import ParallelState
from ..pipeline.shared_embeddings import allreduce_shared_embedding_grads
from ..tensor_parallel.utils import allreduce_sequence_parallel_grads, sequence_parallel_params
from .data_parallel import DataParallelGrads


def _all_reduce_coalesced(grads: List[torch.Tensor], group: dist.ProcessGroup, divisor: int) -> None:
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat /= divisor
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def data_parallel_buckets(params: Iterable[nn.Parameter]) -> Dict[Tuple[str, torch.dtype], List[torch.Tensor]]:
    """Gradients grouped by (reduction group name, dtype), in parameter order."""
    buckets: Dict[Tuple[str, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for param in params:
        if param.grad is not None:
            group = "edp" if getattr(param, "expert_parallel", False) else "dp-cp"
            buckets[(group, param.grad.dtype)].append(param.grad)
    return buckets


def finalize_model_grads(modules: Iterable[nn.Module], state: ParallelState,
                         reduce_data_parallel: bool = True, grads: Optional[DataParallelGrads] = None,
                         params: Optional[Sequence[nn.Parameter]] = None) -> None:
    """Collective over the whole world: call on every rank after the schedule's last backward.

    ``grads``: the model's gradient buffers, when gradients live there (``param.main_grad``).
    ``params``: the modules' trainable parameters, when the caller keeps the list between steps.
    """
    modules = list(modules)
    if params is None:
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
    if grads is not None:
        embedding = (lambda: allreduce_shared_embedding_grads(modules)) if state.pp_size > 1 else None
        if reduce_data_parallel:
            grads.finish_grad_sync(before_isolated=embedding)
        elif embedding is not None:
            embedding()
        if state.tp_size > 1:
            partial = [p.main_grad  # type: ignore[attr-defined]  # runtime attribute
                       for p in sequence_parallel_params(params) if getattr(p, "main_grad", None) is not None]
            if partial:
                _all_reduce_coalesced(partial, state.tp_group, divisor=1)
        return
    if state.tp_size > 1:
        allreduce_sequence_parallel_grads(params, state.tp_group)
    if state.pp_size > 1:
        allreduce_shared_embedding_grads(modules)  # middle stages return at once
    if not reduce_data_parallel:
        return
    divisor = state.size("dp-cp")
    for (name, _), bucket in data_parallel_buckets(params).items():
        if state.size(name) > 1:
            _all_reduce_coalesced(bucket, state.group(name), divisor=divisor)
        elif divisor != 1:   # experts alone in their edp group (edp=1) still summed dp·cp ranks' tokens
            for grad in bucket:
                grad.div_(divisor)
