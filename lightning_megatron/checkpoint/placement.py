"""Where a rank's local tensor sits inside its global (single-process) tensor, as boxes.

A checkpoint stores every tensor in its *global* layout; a rank contributes the boxes it holds.
One local tensor is one or more :class:`Piece` s, each a box of the local tensor and the box of
the global tensor it equals:

- tensor parallelism (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``): with
  stride ``s`` the global dim is ``tp * s`` blocks and rank ``r`` holds blocks ``r, r + tp, ...``
  (SwiGLU ``fc1``: its gate slice and its up slice). Those are ``s`` separate pieces, so the
  stored tensor is the true global one (``[gate | up]``) and any other tp size reads it back
  with plain box overlaps; no stride-permuted layout leaks into the file.
- expert parallelism (``expert_parallel``): dim 0 counts experts; rank ``ep_rank`` holds global
  experts ``first_expert ...``; expert weights are split over the *expert* tensor-parallel
  group (etp), not tp.
- vocabulary padding (``vocab_size`` on the parameter): rows past it are padding whose amount
  depends on the tp size, so they are left out and the global tensor has ``vocab_size`` rows.

Pipeline stages and virtual chunks change names, not boxes (``models.sharding.global_names``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

Box = Tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """``local[local_offsets : +sizes] == global[global_offsets : +sizes]``."""

    local_offsets: Box
    global_offsets: Box
    sizes: Box

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The piece as a view of ``local`` (writes into it land in ``local``)."""
        for dim, (offset, size) in enumerate(zip(self.local_offsets, self.sizes)):
            if offset != 0 or size != local.shape[dim]:
                local = local.narrow(dim, offset, size)
        return local

    def of_global(self, full: torch.Tensor) -> torch.Tensor:
        """The same box cut from the full global tensor."""
        for dim, (offset, size) in enumerate(zip(self.global_offsets, self.sizes)):
            full = full.narrow(dim, offset, size)
        return full


@dataclass(frozen=True)
class Placement:
    """The global shape of a tensor and the pieces of it one rank holds (possibly none)."""

    global_shape: Box
    pieces: Tuple[Piece, ...]


def whole(tensor: torch.Tensor) -> Placement:
    """A tensor every rank holds entirely (replicated; DCP writes one copy)."""
    shape = tuple(tensor.shape)
    zeros = (0,) * len(shape)
    return Placement(shape, (Piece(zeros, zeros, shape),))


@dataclass(frozen=True)
class Ranks:
    """The positions a parameter's placement depends on."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


def placement_of(param: torch.Tensor, ranks: Ranks, first_expert: Optional[int] = None) -> Placement:
    """The global shape of ``param`` and the boxes of it this rank holds (see the module doc)."""
    shape = list(param.shape)
    n = len(shape)
    global_shape = list(shape)
    pieces = [Piece((0,) * n, (0,) * n, tuple(shape))]
    expert = bool(getattr(param, "expert_parallel", False))
    rank, size = (ranks.etp_rank, ranks.etp_size) if expert else (ranks.tp_rank, ranks.tp_size)
    split = bool(getattr(param, "tensor_model_parallel", False)) and size > 1
    dim = getattr(param, "partition_dim", 0) if split else None

    if split:
        assert dim is not None
        stride = getattr(param, "partition_stride", 1) or 1
        if shape[dim] % stride:
            raise ValueError(f"a parameter of shape {tuple(shape)} has partition_stride={stride} that does not "
                             f"divide its partition dim {dim}; fix the layer's tensor-parallel attributes.")
        block = shape[dim] // stride
        global_shape[dim] = shape[dim] * size
        pieces = [_moved(pieces[0], dim, k * block, (rank + k * size) * block, block) for k in range(stride)]

    if expert and ranks.ep_size > 1:
        if split and dim == 0:
            raise ValueError("an expert parameter split over etp along dim 0 (the expert dim) is not "
                                      "supported; split expert weights along another dim.")
        start = first_expert if first_expert is not None else ranks.ep_rank * shape[0]
        global_shape[0] = shape[0] * ranks.ep_size
        pieces = [_moved(p, 0, p.local_offsets[0], p.global_offsets[0] + start, p.sizes[0]) for p in pieces]

    vocab = getattr(param, "vocab_size", None)
    if vocab is not None:
        vdim = dim if dim is not None else getattr(param, "partition_dim", 0)
        if vocab > global_shape[vdim]:
            raise ValueError(f"a parameter tagged vocab_size={vocab} has only {global_shape[vdim]} rows.")
        global_shape[vdim] = vocab
        pieces = [c for c in (_clipped(p, vdim, vocab) for p in pieces) if c is not None]

    return Placement(tuple(global_shape), tuple(pieces))


def _moved(piece: Piece, dim: int, local_offset: int, global_offset: int, size: int) -> Piece:
    def put(box: Box, value: int) -> Box:
        return box[:dim] + (value,) + box[dim + 1:]
    return Piece(put(piece.local_offsets, local_offset), put(piece.global_offsets, global_offset),
                 put(piece.sizes, size))


def _clipped(piece: Piece, dim: int, end: int) -> Optional[Piece]:
    """``piece`` cut to global rows ``[0, end)`` along ``dim``; None when nothing is left."""
    start = piece.global_offsets[dim]
    size = min(piece.sizes[dim], end - start)
    if size <= 0:
        return None
    return _moved(piece, dim, piece.local_offsets[dim], start, size)
