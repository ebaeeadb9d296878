"""Small tensor-parallel helpers: divisibility checks, vocab ranges, parameter partition tags."""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

# Attributes a tensor-parallel parameter carries so clipping and checkpointing can read its sharding.
TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def divide(numerator: int, denominator: int, what: str, by: str = "tensor-parallel size") -> int:
    """``numerator // denominator``, or an error naming both quantities and values that would work."""
    if numerator % denominator:
        lower = numerator - numerator % denominator
        options = [v for v in (lower, lower + denominator) if v > 0]
        raise ValueError(
            f"{what}={numerator} is not divisible by the {by} {denominator}; use a {what} that is a "
            f"multiple of {denominator} (e.g. {' or '.join(map(str, options))}) or change the {by}."
        )
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous: bool = False) -> Tuple[torch.Tensor, ...]:
    """Split the last dimension into ``num_partitions`` equal chunks."""
    size = divide(tensor.shape[-1], num_partitions, "last dimension", by="number of partitions")
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous else chunks


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Round ``vocab_size`` up so every tensor-parallel shard has a multiple of ``multiple`` rows.

    Seed 002: 50,257 GPT-2 tokens become 51,200 for up to 8-way model parallelism.
    """
    if vocab_size < 1 or tp_size < 1 or multiple < 1:
        raise ValueError(f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
                         f"tp_size={tp_size}, multiple={multiple}.")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def vocab_range(padded_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """``[start, end)`` of the vocabulary rows held by ``rank``."""
    per_rank = divide(padded_vocab_size, world_size, "num_embeddings (padded vocabulary)")
    return rank * per_rank, (rank + 1) * per_rank


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    param.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]  # runtime attribute
    param.partition_dim = dim  # type: ignore[attr-defined]  # runtime attribute
    param.partition_stride = stride  # type: ignore[attr-defined]  # runtime attribute


def copy_tensor_model_parallel_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    for name in TP_ATTRIBUTES:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def param_is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: Optional[int] = None) -> bool:
    """True for a shard of a split parameter, or for the tp-rank-0 copy of a replicated one.

    Counting only these in a grad norm counts every element of the model exactly once.
    """
    if param_is_tensor_parallel(param):
        return True
    if tp_rank is None:
        from ..parallel import get_parallel_state, has_parallel_state
        tp_rank = get_parallel_state().tp_rank if has_parallel_state() else 0
    return tp_rank == 0


def sequence_parallel_params(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    """Parameters replicated across tp whose gradients are partial under sequence parallelism."""
    return [p for p in params if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter],
                                      group: Optional[dist.ProcessGroup] = None) -> None:
    """Sum the gradients of sequence-parallel parameters (biases, norms) over the tp group.

    Each rank saw only its slice of the sequence, so its gradient is a partial sum.
    """
    from .mappings import resolve_group

    group = resolve_group(group)
    grads = [p.grad for p in sequence_parallel_params(params) if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def in_autocast_dtype(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on for ``reference``'s device (as ``F.linear`` would run it),
    so an autograd function's GEMMs and their backward see one dtype."""
    device = reference.device.type
    if not torch.is_autocast_enabled(device) or not x.is_floating_point():
        return x
    return x.to(torch.get_autocast_dtype(device))
