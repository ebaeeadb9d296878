"""Data-parallel gradients of one model: buffers per (group, dtype), hooks, reduction when due.

Convention (Megatron's): autograd still writes ``param.grad``, and a post-accumulate-grad hook
adds it into ``param.main_grad`` (a view of the buffer) and frees it, so a gradient lives in one
place across micro-batches and accumulation steps. ``attach()`` hands ``main_grad`` back as
``param.grad`` for an optimizer that reads ``.grad`` (a view when the dtypes match, a cast copy
when the buffer is float32 under bf16 parameters); ``detach()`` takes it away again.

Reduction happens once per optimizer step, after the last gradient of the last micro-batch of
the last accumulation step: ``no_sync()`` marks everything before that. With
``overlap_grad_reduce`` a bucket's reduction is issued from the hook of its last parameter to
become ready outside ``no_sync``; ``finish_grad_sync()`` issues what is left and waits for all.
Without it, ``finish_grad_sync()`` does the whole reduction after the schedule.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .grad_buffer import Bucket, GradBuffer

DEFAULT_BUCKET_ELEMENTS = 40_000_000   # Megatron's default: max(40M, 1M · dp) elements


def default_bucket_size(overlap_grad_reduce: bool, dp_size: int) -> Optional[int]:
    """One bucket when nothing overlaps; otherwise buckets big enough to keep the links busy."""
    return max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_size) if overlap_grad_reduce else None


class DataParallelGrads:
    """Gradient buffers, hooks and data-parallel reduction for ``params``.

    Args:
        params: trainable parameters in registration order (``module.parameters()``).
        dense_group / expert_group: reduction groups (``dp-cp`` and ``edp``); expert parameters
            carry ``expert_parallel=True``.
        divisor: the sum over the group is divided by it (dp·cp, see ``finalize.py``).
        overlap_grad_reduce: issue each bucket's reduction from the backward as soon as it is ready.
        bucket_size: elements per bucket (``None``: one bucket per buffer).
        grad_reduce_in_fp32: accumulate and reduce low-precision gradients in float32.
        shard: reduce-scatter instead of all-reduce (for the distributed optimizer).
        isolate: parameters that get their own bucket, reduced only in ``finish_grad_sync`` after
            its ``before_isolated`` callback (tied embeddings summed across pipeline stages first).
    """

    def __init__(self, params: Sequence[nn.Parameter], dense_group: Optional[dist.ProcessGroup],
                 expert_group: Optional[dist.ProcessGroup] = None, divisor: int = 1, *,
                 overlap_grad_reduce: bool = False, bucket_size: Optional[int] = None,
                 grad_reduce_in_fp32: bool = False, shard: bool = False,
                 isolate: Callable[[nn.Parameter], bool] = lambda p: False) -> None:
        self.overlap_grad_reduce = overlap_grad_reduce
        self._sync = True
        by_key: Dict[Tuple[bool, torch.dtype], List[nn.Parameter]] = {}
        for param in params:
            if param.requires_grad:
                by_key.setdefault((bool(getattr(param, "expert_parallel", False)), param.dtype), []).append(param)
        self.buffers: List[GradBuffer] = []
        self.expert: List[bool] = []   # per buffer: reduced over the expert group
        for (expert, dtype), group_params in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            grad_dtype = torch.float32 if grad_reduce_in_fp32 and dtype in (torch.bfloat16, torch.float16) else dtype
            ordered = group_params[::-1]   # backward order
            self.buffers.append(GradBuffer(ordered, grad_dtype, expert_group if expert else dense_group, divisor,
                                           bucket_size, shard, [isolate(p) for p in ordered]))
            self.expert.append(expert)
        self._where: Dict[int, Tuple[GradBuffer, Bucket]] = {
            id(p): (buf, buf.bucket_of[id(p)]) for buf in self.buffers for p in buf.params}
        self.params: List[nn.Parameter] = [p for buf in self.buffers for p in buf.params]
        self.issued: List[Tuple[int, int]] = []   # (buffer, bucket) in the order reductions were issued
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # -- the backward ------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        if getattr(param, "grad_added_to_main_grad", False):   # its GEMM accumulated it (grad_accumulation.py)
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]  # runtime attribute
        elif param.grad is None:   # the accumulator was reached with no gradient: a compiled layer's own edge to a
            return                 # weight whose gradient its GEMM accumulates or the zero-bubble W step will
        else:
            param.main_grad.add_(param.grad)  # type: ignore[attr-defined]  # runtime attribute
            param.grad = None
        if not (self.overlap_grad_reduce and self._sync):
            return
        buffer, bucket = self._where[id(param)]
        if bucket.started:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} received a gradient after its bucket's reduction "
                "had started: it was used again in the last micro-batch's backward. Run that backward in one "
                "call, or set overlap_grad_reduce=False.")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and not bucket.isolated:
            self._issue(buffer, bucket)

    def _issue(self, buffer: GradBuffer, bucket: Bucket) -> None:
        if not bucket.started:
            self.issued.append((self.buffers.index(buffer), bucket.index))
        buffer.start(bucket)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients produced inside accumulate only; nests (the outermost decides)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def finish_grad_sync(self, before_isolated: Optional[Callable[[], None]] = None) -> None:
        """Issue every reduction not yet issued, run ``before_isolated``, then reduce the isolated
        buckets and wait for all. A collective over every reduction group: call it on every rank."""
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                if not bucket.isolated:
                    self._issue(buffer, bucket)
        if before_isolated is not None:
            before_isolated()
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                self._issue(buffer, bucket)
                buffer.wait(bucket)
            buffer.reset()

    # -- what the optimizer sees -------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a new accumulation window: buffers to zero, no ``.grad`` anywhere."""
        for buffer in self.buffers:
            buffer.zero_()
        for param in self.params:
            param.grad = None
        self.issued.clear()

    def attach(self) -> None:
        """``param.grad = param.main_grad`` (cast to the parameter's dtype if the buffer's differs)."""
        for param in self.params:
            grad = param.main_grad  # type: ignore[attr-defined]  # runtime attribute
            param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)

    def detach(self) -> None:
        for param in self.params:
            param.grad = None

    def signature(self) -> int:
        """A checksum of the dense buffers' layout: equal on two ranks iff their shards hold the same
        elements (tp peers of one model must agree, see ``finalize.py``)."""
        return zlib.crc32(repr([buf.signature() for buf, expert in zip(self.buffers, self.expert)
                                if not expert]).encode())

    def close(self) -> None:
        """Remove the hooks and ``main_grad`` (code that prefers ``main_grad`` must not see a stale one)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for param in self.params:
            if hasattr(param, "main_grad"):
                del param.main_grad
