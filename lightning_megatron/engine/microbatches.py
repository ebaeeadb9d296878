"""Split one batch into equal micro-batches along dim 0, whatever its structure."""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, cast

import torch


def batch_size_of(batch: Any) -> Optional[int]:
    """Size of dim 0 of the first tensor found in ``batch`` (None when it holds no tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values: Iterable[Any]
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for value in values:
        size = batch_size_of(value)
        if size is not None:
            return size
    return None


def split_into_microbatches(batch: Any, micro_batch_size: Optional[int], allow_smaller_last: bool = False) -> List[Any]:
    """``batch`` cut into ``B / micro_batch_size`` pieces; tensors split along dim 0, other leaves
    (strings, numbers) repeated. ``None`` keeps the batch whole.

    ``allow_smaller_last`` (evaluation): a batch that ``micro_batch_size`` does not divide (the ragged
    last batch of a validation set) ends in a smaller micro-batch instead of raising; a training step
    refuses it, since its micro-batches are averaged with equal weights."""
    size = batch_size_of(batch)
    if micro_batch_size is None or size is None:
        return [batch]
    if size % micro_batch_size and not allow_smaller_last:
        raise ValueError(
            f"the batch has {size} samples per data-parallel rank, which micro_batch_size={micro_batch_size} "
            f"does not divide; use a batch size that is a multiple of {micro_batch_size} (with drop_last=True "
            "for a smaller last batch) or a micro_batch_size that divides it."
        )
    starts = range(0, size, micro_batch_size)
    return [_take(batch, start, min(start + micro_batch_size, size), size) for start in starts]


def ragged_last_batch(loader: Any, micro_batch_size: Optional[int]) -> Optional[int]:
    """The samples per data-parallel rank of ``loader``'s last batch of an epoch when ``micro_batch_size`` does
    not divide them (that training step will be refused), else ``None``. Known for a loader with a batch size
    over a sampler of known length, without ``drop_last``."""
    batch_size, sampler = getattr(loader, "batch_size", None), getattr(loader, "sampler", None)
    if micro_batch_size is None or not batch_size or getattr(loader, "drop_last", False):
        return None
    try:
        samples = len(sampler)  # type: ignore[arg-type]   # None or a stream: TypeError, as for IterableDataset
    except TypeError:   # an IterableDataset's stream: no length
        return None
    last = samples % batch_size
    return last if last and last % micro_batch_size else None


def _take(batch: Any, start: int, end: int, size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return cast(Any, type(batch))({k: _take(v, start, end, size) for k, v in batch.items()}) if not hasattr(
            batch, "_fields") else batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(v, start, end, size) for v in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == size and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            return type(batch)(batch[start:end])   # a list of per-sample leaves (e.g. strings)
        return type(batch)(_take(v, start, end, size) for v in batch)
    return batch
