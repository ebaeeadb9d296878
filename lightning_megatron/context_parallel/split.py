"""How a sequence is laid out over the context-parallel ranks: pure functions of tensors and integers.

Causal attention makes late tokens costlier than early ones (token t attends to t+1 keys), so
contiguous slices would leave rank 0 idle while the last rank works. The sequence is instead cut
into ``2·cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2·cp-1-i``: every rank gets one
cheap and one expensive chunk and the same amount of attention work. Non-causal models use the
same layout, so one split serves every model and every ``[b, s]`` tensor of a batch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, overload

import torch


def _check_cp(cp_size: int, cp_rank: Optional[int] = None) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}.")
    if cp_rank is not None and (isinstance(cp_rank, bool) or not isinstance(cp_rank, int)
                                or not 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank must be an integer in [0, {cp_size}) for cp_size={cp_size}, got {cp_rank!r}.")


def check_sequence_length(seq_len: int, cp_size: int, what: str = "sequence length") -> int:
    """The chunk length ``seq_len / (2·cp_size)``; a ``ValueError`` naming the nearest valid lengths if
    ``seq_len`` is not a multiple of ``2·cp_size``."""
    _check_cp(cp_size)
    chunks = 2 * cp_size
    if seq_len % chunks:
        below, above = seq_len // chunks * chunks, (seq_len // chunks + 1) * chunks
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"{what} {seq_len} is not divisible by 2*cp_size = {chunks}: context parallelism cuts the "
            f"sequence into 2*cp_size chunks (rank i holds chunks i and {chunks - 1}-i). Pad or truncate "
            f"the sequence to a multiple of {chunks}, e.g. {nearest}.")
    return seq_len // chunks


def check_local_sequence_length(local_seq_len: int, cp_size: int) -> int:
    """The chunk length ``local_seq_len / 2`` of a rank's slice; a ``ValueError`` saying the fix if odd."""
    if local_seq_len % 2:
        raise ValueError(
            f"the local sequence length {local_seq_len} is odd: under context parallelism each rank holds two "
            f"equal chunks; split batches with split_for_context_parallel(batch, cp_size={cp_size}, cp_rank) "
            f"from a sequence length divisible by 2*cp_size = {2 * cp_size}.")
    return local_seq_len // 2


def chunk_order(cp_size: int) -> List[int]:
    """Global chunk ids in the order the ranks hold them, rank 0 first: ``[0, 2cp-1, 1, 2cp-2, ...]``.

    This is also the order of an all-gather over the cp group of every rank's slice.
    """
    _check_cp(cp_size)
    return [chunk for rank in range(cp_size) for chunk in (rank, 2 * cp_size - 1 - rank)]


def _split_tensor(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int, what: str) -> torch.Tensor:
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for {what} of shape {tuple(x.shape)}.")
    length = check_sequence_length(x.shape[seq_dim], cp_size, f"{what}: sequence length (dim {seq_dim})")
    first, second = local_chunks(cp_size, cp_rank)
    return torch.cat([x.narrow(seq_dim, first * length, length), x.narrow(seq_dim, second * length, length)],
                     dim=seq_dim)


@overload
def split_for_context_parallel(batch: torch.Tensor, cp_size: int, cp_rank: int,
                               seq_dim: int = 1, keys: Optional[Sequence[str]] = None) -> torch.Tensor: ...
@overload
def split_for_context_parallel(batch: Mapping[str, Any], cp_size: int, cp_rank: int,
                               seq_dim: int = 1, keys: Optional[Sequence[str]] = None) -> Dict[str, Any]: ...
def split_for_context_parallel(batch: Union[torch.Tensor, Mapping[str, Any]], cp_size: int, cp_rank: int,
                               seq_dim: int = 1, keys: Optional[Sequence[str]] = None
                               ) -> Union[torch.Tensor, Dict[str, Any]]:
    """This cp rank's load-balanced slice (chunks ``cp_rank`` and ``2·cp_size-1-cp_rank``) along ``seq_dim``.

    ``batch`` is a tensor or a mapping (returned as a ``dict``). In a mapping, every tensor with a
    ``seq_dim`` axis is split (``[b, s]`` ids, labels, masks, position ids) and everything else
    (``[b]`` class labels, non-tensors) is passed through; ``keys`` restricts the split to the named
    entries. With ``cp_size == 1`` nothing is split. Inverse: :func:`gather_context_parallel_slices`.
    """
    _check_cp(cp_size, cp_rank)
    if cp_size == 1:
        return batch if isinstance(batch, torch.Tensor) else dict(batch)
    if isinstance(batch, torch.Tensor):
        return _split_tensor(batch, cp_size, cp_rank, seq_dim, "tensor")
    if not isinstance(batch, Mapping):
        raise TypeError(f"split_for_context_parallel takes a tensor or a mapping of tensors, "
                        f"got {type(batch).__name__}.")
    if keys is not None:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"keys {missing} are not in the batch (its keys: {list(batch)}).")
    out = {}
    for key, value in batch.items():
        has_axis = isinstance(value, torch.Tensor) and (
            value.dim() > seq_dim if seq_dim >= 0 else value.dim() >= -seq_dim)
        if keys is not None and key in keys and not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] is a {type(value).__name__}, not a tensor; it cannot be split.")
        if (key in keys) if keys is not None else has_axis:
            value = _split_tensor(value, cp_size, cp_rank, seq_dim, f"batch[{key!r}]")
        out[key] = value
    return out


def sequence_keys(batch: Any, seq_dim: int = 1) -> Optional[List[str]]:
    """The entries of a mapping batch that are sequences: tensors whose ``seq_dim`` has the length of
    ``batch["input_ids"]`` (else of the first tensor with that axis). A ``[b, 4]`` per-sample vector beside
    ``[b, s]`` ids is not one. ``None`` for a batch that is not a mapping (split as before)."""
    if not isinstance(batch, Mapping):
        return None
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > seq_dim}
    if not tensors:
        return []
    ids = tensors.get("input_ids")
    length = (ids if ids is not None else next(iter(tensors.values()))).shape[seq_dim]
    return [k for k, v in tensors.items() if v.shape[seq_dim] == length]


def gather_context_parallel_slices(slices: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's slice (``slices[r]`` from rank ``r``): the inverse of
    :func:`split_for_context_parallel`. For outputs and tests; inside a model use the collective
    ``all_gather_context_parallel``."""
    cp_size = len(slices)
    _check_cp(cp_size)
    if cp_size == 1:
        return slices[0]
    return reorder_to_sequence(torch.cat(list(slices), dim=seq_dim), cp_size, seq_dim)


def _permute_chunks(x: torch.Tensor, order: Sequence[int], seq_dim: int) -> torch.Tensor:
    seq_dim = seq_dim % x.dim()
    length = check_sequence_length(x.shape[seq_dim], len(order) // 2)
    chunks = x.split(length, dim=seq_dim)
    return torch.cat([chunks[i] for i in order], dim=seq_dim)


def reorder_to_sequence(gathered: torch.Tensor, cp_size: int, seq_dim: int) -> torch.Tensor:
    """Rank-ordered chunks (an all-gather of every rank's slice) → the natural sequence order."""
    slot_of = {chunk: slot for slot, chunk in enumerate(chunk_order(cp_size))}
    return _permute_chunks(gathered, [slot_of[c] for c in range(2 * cp_size)], seq_dim)


def reorder_to_ranks(sequence: torch.Tensor, cp_size: int, seq_dim: int) -> torch.Tensor:
    """The natural sequence order → rank-ordered chunks, so rank ``r``'s slice is the ``r``-th block."""
    return _permute_chunks(sequence, chunk_order(cp_size), seq_dim)


def context_parallel_position_ids(local_seq_len: int, cp_size: int, cp_rank: int,
                                  device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """Global positions ``[local_seq_len]`` of the tokens cp rank ``cp_rank`` holds (``local_seq_len``
    is that rank's share, ``seq_len / cp_size``)."""
    _check_cp(cp_size, cp_rank)
    if cp_size > 1:
        check_local_sequence_length(local_seq_len, cp_size)
    positions = torch.arange(local_seq_len * cp_size, device=device)
    return split_for_context_parallel(positions, cp_size, cp_rank, seq_dim=0)


def local_chunks(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two global chunk ids cp rank ``cp_rank`` holds, in the order of its slice."""
    _check_cp(cp_size, cp_rank)
    return cp_rank, 2 * cp_size - 1 - cp_rank
