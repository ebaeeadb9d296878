"""Expert rows laid out so that every expert's group starts and ends on a multiple of ``alignment``.

Float8 grouped GEMMs (``torch._scaled_grouped_mm``, which torchao's float8 grouped matmul calls) need
each group's row count to be a multiple of 16, and dropless routing gives experts any count. The rows
are copied into a buffer of static size ``round_up(rows + experts·(alignment-1), alignment)`` (every
layout fits; nothing is read on the host, so CUDA graphs can capture it), each expert's rows followed by
zero rows up to its aligned end; the zero rows that are left over join the last group. A zero row
stays zero through ``x W1ᵀ``, the activation (SwiGLU, GELU) and ``h W2ᵀ``, adds nothing to the weight
gradients and does not change a row-wise or per-group float8 scale, so the real rows' results are
those of the unaligned layout.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def aligned_capacity(rows: int, groups: int, alignment: int) -> int:
    """Rows of the aligned buffer: room for every group padded by up to ``alignment - 1`` rows."""
    size = rows + groups * (alignment - 1)
    return -(-size // alignment) * alignment


def align_groups(x: Tensor, counts: Tensor, alignment: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``x [R, H]`` (rows of group 0, then group 1, ...; ``R = counts.sum()``) into the aligned buffer.

    Returns ``(aligned [C, H], rows [R], offsets [G] int32)``: ``aligned[rows[i]] = x[i]``, every other row
    zero; ``offsets`` the groups' cumulative aligned ends, the last one ``C``. Differentiable in ``x``.
    """
    groups = counts.numel()
    capacity = aligned_capacity(x.shape[0], groups, alignment)
    counts = counts.to(device=x.device, dtype=torch.int64)
    padded = (counts + alignment - 1) // alignment * alignment
    ends = padded.cumsum(0)
    moved = (ends - padded) - (counts.cumsum(0) - counts)      # each group's shift: aligned start - packed start
    index = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(counts.cumsum(0), index, right=True).clamp_(max=groups - 1)
    rows = index + moved[group]
    offsets = torch.cat([ends[:-1], ends.new_full((1,), capacity)]).to(torch.int32)
    aligned = x.new_zeros(capacity, x.shape[1]).index_copy(0, rows, x)
    return aligned, rows, offsets
