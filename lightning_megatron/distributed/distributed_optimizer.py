"""Distributed optimizer (ZeRO-1): main parameters and optimizer state sharded over data parallelism.

Each data-parallel rank owns chunk r of every gradient bucket (``GradBuffer(shard=True)``, whose
reduction is a reduce-scatter). For every parameter piece in that chunk it keeps a *main* shard:
a view of the parameter itself when the parameter is float32 (no copy), a float32 copy otherwise
(bf16/fp16 training). The user's optimizer is re-pointed at these shards: its ``param_groups``
keep their dicts (so an LR scheduler holding the optimizer keeps steering it) and only their
``"params"`` lists change. It then steps on 1/DP of the model, with state for 1/DP of it;
``gather_params()`` copies the shards back into the parameters and all-gathers every bucket.

That is exact only for optimizers whose update of an element depends on that element alone
(SGD, Adam, AdamW, ...); others are refused by name (see :func:`check_shardable`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .data_parallel import DataParallelGrads
from .grad_buffer import GradBuffer
from .param_buffer import ParamBuffer, ParamGather

ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name))
NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon")
                        if hasattr(torch.optim, name))


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless each element's update depends only on that element (then sharding is exact).

    A class of one's own opts in with the class attribute ``shardable = True``.
    """
    cls = type(optimizer)
    if getattr(cls, "shardable", None) is True:
        return
    if isinstance(optimizer, NOT_ELEMENTWISE) or getattr(cls, "shardable", None) is False:
        raise ValueError(
            f"use_distributed_optimizer=True cannot shard {cls.__name__}: its update of an element depends on "
            "other elements of the parameter (line search, factored or matrix statistics), which a 1/DP shard "
            "does not hold. Use an elementwise optimizer (SGD, Adam, AdamW, ...) or set "
            "use_distributed_optimizer=False.")
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"use_distributed_optimizer=True does not know whether {cls.__name__} updates each element from that "
            f"element alone. If it does, declare it with the class attribute `{cls.__name__}.shardable = True`; "
            "otherwise set use_distributed_optimizer=False.")


@dataclass(eq=False)
class Shard:
    """The piece ``[start, end)`` (buffer offsets) of ``param`` that this rank updates."""

    param: nn.Parameter
    main: nn.Parameter
    grads: GradBuffer
    params: ParamBuffer
    start: int
    end: int

    @property
    def param_start(self) -> int:
        return self.start - self.grads.ranges[id(self.param)][0]

    @property
    def param_end(self) -> int:
        return self.end - self.grads.ranges[id(self.param)][0]

    def piece_of(self, value: Any, elementwise: Optional[bool] = None) -> Any:
        """This shard's piece of a per-element state tensor of the whole parameter; anything else as is.
        ``elementwise=None``: per-element iff it has the parameter's shape (and is not a scalar)."""
        if elementwise is None:
            elementwise = torch.is_tensor(value) and value.dim() > 0 and value.shape == self.param.shape
        return value.reshape(-1)[self.param_start:self.param_end].clone() if elementwise else value

    @property
    def is_view(self) -> bool:
        """The main shard is the parameter's own memory (float32 parameters)."""
        return self.main.data_ptr() == self.params.data[self.start:self.end].data_ptr()


class DistributedOptimizer:
    """Shards the optimizers' parameters and state over the data-parallel groups of ``grads``.

    Args:
        optimizers: the user's optimizers, built over the model's parameters; re-pointed in place.
        grads: the model's gradient buffers, built with ``shard=True``.
        modules: the model (for the forward pre-hooks of ``overlap_param_gather``).
        overlap_param_gather: issue the all-gathers after the step and wait for each bucket only when
            the forward first needs it.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], grads: DataParallelGrads,
                 modules: Sequence[nn.Module] = (), overlap_param_gather: bool = False) -> None:
        for optimizer in optimizers:
            check_shardable(optimizer)
        if not all(buf.shard for buf in grads.buffers):
            raise ValueError("DistributedOptimizer needs gradient buffers built with DataParallelGrads(shard=True).")
        self.grads = grads
        self.param_buffers = [ParamBuffer(buf) for buf in grads.buffers]
        self.gather = ParamGather(self.param_buffers, modules, overlap_param_gather)
        self.shards: List[Shard] = []
        for buf, pbuf in zip(grads.buffers, self.param_buffers):
            for bucket in buf.buckets:
                lo, hi = buf.shard_range(bucket)
                for param in bucket.params:
                    start, end = buf.ranges[id(param)]
                    start, end = max(start, lo), min(end, hi)
                    if start < end:
                        self.shards.append(Shard(param, _main_param(param, pbuf.data[start:end]), buf, pbuf,
                                                 start, end))
        self._shard_of_param: Dict[int, Shard] = {id(s.param): s for s in self.shards}
        self._shard_of_main: Dict[int, Shard] = {id(s.main): s for s in self.shards}
        self.originals: Dict[int, List[nn.Parameter]] = {}    # id(optimizer) -> its params, as built
        self.group_sizes: Dict[int, List[int]] = {}            # id(optimizer) -> params per group, as built
        self.optimizers = list(optimizers)
        for optimizer in self.optimizers:
            self._repoint(optimizer)

    def _repoint(self, optimizer: torch.optim.Optimizer) -> None:
        """Shards in place of parameters; state already there (Adagrad makes it in ``__init__``) is cut
        down to this rank's pieces."""
        trainable = {id(p) for p in self.grads.params}
        existing = {id(p): state for p, state in optimizer.state.items()}
        self.originals[id(optimizer)] = [p for group in optimizer.param_groups for p in group["params"]]
        self.group_sizes[id(optimizer)] = [len(group["params"]) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and id(param) not in trainable:
                    raise ValueError(f"{type(optimizer).__name__} holds a parameter of shape {tuple(param.shape)} "
                                     "that is not a trainable parameter of the model; build the optimizer over "
                                     "the model's parameters (self.parameters()).")
            group["params"] = [self._shard_of_param[id(p)].main for p in group["params"]
                               if id(p) in self._shard_of_param]
        optimizer.state = defaultdict(dict)
        for param in self.originals[id(optimizer)]:
            if id(param) in existing and id(param) in self._shard_of_param:
                shard = self._shard_of_param[id(param)]
                optimizer.state[shard.main] = {k: shard.piece_of(v) for k, v in existing[id(param)].items()}

    # -- one step ------------------------------------------------------------------------------------
    @property
    def main_params(self) -> List[nn.Parameter]:
        return [s.main for s in self.shards]

    def shard_of(self, main: nn.Parameter) -> Shard:
        return self._shard_of_main[id(main)]

    def attach_grads(self) -> None:
        """Each main shard's ``.grad``: its (reduce-scattered) piece of the gradient buffer."""
        for shard in self.shards:
            grad = shard.grads.data[shard.start:shard.end]
            shard.main.grad = grad if grad.dtype == shard.main.dtype else grad.to(shard.main.dtype)

    def detach_grads(self) -> None:
        for shard in self.shards:
            shard.main.grad = None

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the step: copy the main shards into the parameters, all-gather every bucket."""
        for shard in self.shards:
            if not shard.is_view:
                shard.params.data[shard.start:shard.end].copy_(shard.main)
        self.gather.start()

    def finish_param_sync(self) -> None:
        """Wait for all-gathers still in flight (``overlap_param_gather``)."""
        self.gather.finish()

    @torch.no_grad()
    def reload_main_params(self) -> None:
        """Main shards from the parameters again (after loading weights into the model)."""
        self.finish_param_sync()
        for shard in self.shards:
            if not shard.is_view:
                shard.main.copy_(shard.params.data[shard.start:shard.end])

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (and float32 main copies) this rank holds."""
        total = sum(s.main.numel() * s.main.element_size() for s in self.shards if not s.is_view)
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total

    def close(self) -> None:
        self.finish_param_sync()
        self.gather.remove_hooks()


def _main_param(param: nn.Parameter, piece: torch.Tensor) -> nn.Parameter:
    """float32 parameters are their own main copy; lower precision gets a float32 copy."""
    low = param.dtype in (torch.float16, torch.bfloat16)
    main = nn.Parameter(piece.detach().float().clone() if low else piece.detach(), requires_grad=True)
    for key, value in vars(param).items():   # tensor_model_parallel, expert_parallel, ...: clipping reads them
        if not key.startswith("_") and key != "main_grad":
            setattr(main, key, value)
    return main


__all__ = ["DistributedOptimizer", "Shard", "check_shardable"]
