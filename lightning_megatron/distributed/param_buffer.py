"""Parameters as views of one flat tensor laid out like their gradient buffer, re-assembled after
each sharded optimizer step by an all-gather per bucket.

Each data-parallel rank updates only its chunk of every bucket; an all-gather of the bucket, in
place, brings everyone's chunks back. With ``overlap`` the all-gathers are issued at once (in
forward order: last bucket first) and each module waits, in a forward pre-hook, only for the
buckets holding its own parameters, so the gather of later layers overlaps the forward of earlier
ones; that pre-hook runs before the module's other pre-hooks (which may read the parameters: the float8
weights' casts, ``quantization/float8_weights.py``). A parameter read outside its owner's forward before then
would be stale: call ``finish()`` before reading parameters directly (checkpoints, evaluation code that bypasses
``forward``).

A module whose class sets ``wait_for_params_as_one = True`` (the transformer layer), or one compiled with
``module.compile()``, waits once, before its own forward, for every parameter below it, and its submodules
wait for nothing: its bodies may be compiled or CUDA-graphed, and a wait inside them would split the compiled
graph at every norm and linear (the GPT-1.3B step at DP4 ran its norms, GeLU and concatenations eagerly for
it) or be skipped by a graph replay.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from .collectives import all_gather
from .grad_buffer import Bucket, GradBuffer


class ParamBuffer:
    """The parameters of ``grads`` moved into one flat tensor of their dtype (values kept)."""

    def __init__(self, grads: GradBuffer) -> None:
        self.grads = grads
        first = grads.params[0]
        self.data = torch.zeros(grads.numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for param in grads.params:
                start, end = grads.ranges[id(param)]
                view = self.data[start:end].view_as(param)
                view.copy_(param.data)
                param.data = view
        self.handles: Dict[int, Any] = {}   # bucket index -> async all-gather in flight

    def start(self, bucket: Bucket) -> None:
        if self.grads.group_size == 1 or bucket.index in self.handles:
            return
        lo, hi = self.grads.shard_range(bucket)
        self.handles[bucket.index] = all_gather(self.data[bucket.start:bucket.end], self.data[lo:hi],
                                                group=self.grads.group, async_op=True)

    def wait(self, bucket: Bucket) -> None:
        handle = self.handles.pop(bucket.index, None)
        if handle is not None:
            handle.wait()


class ParamGather:
    """All-gathers of every parameter buffer after a step; with ``overlap``, waited for lazily."""

    def __init__(self, buffers: Sequence[ParamBuffer], modules: Sequence[nn.Module] = (),
                 overlap: bool = False) -> None:
        self.buffers = list(buffers)
        self.overlap = overlap
        self._hooks: List[Any] = []
        if overlap:
            where: Dict[int, Tuple[ParamBuffer, Bucket]] = {
                id(p): (pb, pb.grads.bucket_of[id(p)]) for pb in self.buffers for p in pb.grads.params}
            seen = set()
            for root in modules:
                for module in root.modules():   # parents before their children
                    if id(module) in seen:
                        continue
                    seen.add(id(module))
                    as_one = waits_as_one(module)
                    if as_one:
                        seen.update(id(m) for m in module.modules())
                    mine = {id(b): (pb, b) for p in module.parameters(recurse=as_one)
                            if id(p) in where for pb, b in [where[id(p)]]}
                    if mine:
                        # first of the module's pre-hooks: the others (float8 casts) read current parameters
                        self._hooks.append(module.register_forward_pre_hook(_waiter(list(mine.values())),
                                                                            prepend=True))

    def start(self) -> None:
        """Issue every bucket's all-gather; without overlap, also wait for them."""
        for pb in self.buffers:
            for bucket in reversed(pb.grads.buckets):   # forward order: the first layers' buckets first
                pb.start(bucket)
        if not self.overlap:
            self.finish()

    def finish(self) -> None:
        """Wait for every all-gather still in flight (parameters are current afterwards)."""
        for pb in self.buffers:
            for bucket in reversed(pb.grads.buckets):
                pb.wait(bucket)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def waits_as_one(module: nn.Module) -> bool:
    """Whether ``module`` waits once, before its own forward, for every parameter below it (its class says so, or
    it is compiled whole with ``module.compile()``): the rule the gathers' waits and the float8 weights' casts
    (``quantization/float8_weights.py``) share, so a cast's pre-hook sits on the module whose wait precedes it."""
    return bool(getattr(module, "wait_for_params_as_one", False)
                or getattr(module, "_compiled_call_impl", None) is not None)


def _waiter(pairs: List[Tuple[ParamBuffer, Bucket]]) -> Any:
    def wait_for_own_params(module: nn.Module, args: Any) -> None:
        for pb, bucket in pairs:
            pb.wait(bucket)
    return wait_for_own_params
