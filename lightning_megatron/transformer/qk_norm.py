"""OLMo-2's query/key norm: one RMSNorm over the whole projection width (all heads), under tensor parallelism.

Hugging Face's ``Olmo2Attention`` normalises ``q_proj(x)`` and ``k_proj(x)`` over all heads' channels together,
so a token's scale depends on every head, while a tp rank holds only some of them: the per-token sum of squares
is all-reduced over the tp group (forward and backward). The weight covers all heads and is the same on every
rank, so checkpoints and the Hugging Face import/export see exactly HF's tensor; each rank uses its heads' slice,
and the gradient finalisation sums the partial weight gradients over tp (``param.sequence_parallel``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel.mappings import eager_under_compile


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; every rank's output depends on every rank's input, so backward sums too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone().contiguous()   # dist.all_reduce works in place
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone().contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@eager_under_compile
def _all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _AllReduceSum.apply(x, group)
    return out


class AcrossHeadsRMSNorm(nn.Module):
    """RMSNorm over all heads' channels of a token, of which this rank holds ``[b, local_heads, s, head_dim]``.

    ``weight`` is ``[num_heads * head_dim]`` (HF's ``q_norm``/``k_norm`` tensor), replicated over tp ranks.
    ``zero_centered``: scale by ``1 + weight``, weight initialised to 0 (Gemma's convention).
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float, params_dtype: torch.dtype = torch.float32,
                 zero_centered: bool = False) -> None:
        super().__init__()
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be positive, got {num_heads} and {head_dim}.")
        self.num_heads, self.head_dim, self.eps, self.zero_centered = num_heads, head_dim, eps, zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(num_heads * head_dim, dtype=params_dtype))
        # each rank's heads give a partial gradient (nonzero on its slice only): summed over tp when finalised
        self.weight.sequence_parallel = True  # type: ignore[attr-defined]  # runtime attribute

    def forward(self, x: torch.Tensor, first_head: int, group: Optional[dist.ProcessGroup],
                sharing: int = 1) -> torch.Tensor:
        """``x [b, local_heads, s, head_dim]``: heads ``first_head ..`` of the global ones; ``group``: the tp group
        (None: no communication); ``sharing``: how many of its ranks hold the same heads (replicated key/value
        heads), each counted that many times by the group's sum of squares, so it is divided by ``sharing``."""
        (out,) = normalize_across_heads([(self, x, first_head, sharing)], group)
        return out

    def check(self, x: torch.Tensor, first_head: int, size: int, sharing: int) -> None:
        """Raise ValueError unless ``x`` holds whole heads from ``first_head`` on and ``size`` ranks, ``sharing``
        per head, cover the heads exactly once."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"expected x of shape [b, heads, s, {self.head_dim}], got {tuple(x.shape)}.")
        local = x.shape[1]
        if first_head < 0 or first_head + local > self.num_heads:
            raise ValueError(f"heads {first_head}..{first_head + local - 1} are not among the {self.num_heads} heads.")
        if sharing < 1 or size * local != self.num_heads * sharing:
            # the group's sum of squares would not count every head exactly ``sharing`` times
            raise ValueError(f"{size} rank(s) holding {local} head(s) each, {sharing} rank(s) per head, do not "
                             f"cover {self.num_heads} heads exactly once.")

    def scale(self, xf: torch.Tensor, squares: torch.Tensor, first_head: int, sharing: int,
              dtype: torch.dtype) -> torch.Tensor:
        """``xf`` (float32) normalised by the group's per-token ``squares`` ``[b, 1, s, 1]``, scaled by its heads'
        weights, in ``dtype``."""
        variance = squares / (sharing * self.num_heads * self.head_dim)
        normed = xf * torch.rsqrt(variance + self.eps)
        local = xf.shape[1]
        weight = self.weight[first_head * self.head_dim:(first_head + local) * self.head_dim]
        weight = weight.view(1, local, 1, self.head_dim).float()
        if self.zero_centered:
            weight = 1.0 + weight
        return (weight * normed).to(dtype)   # as Olmo2RMSNorm: weight times float32 norm, then cast

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, eps={self.eps}, zero_centered={self.zero_centered}"


def normalize_across_heads(norms: Sequence[Tuple[AcrossHeadsRMSNorm, torch.Tensor, int, int]],
                           group: Optional[dist.ProcessGroup]) -> List[torch.Tensor]:
    """Each ``(norm, x, first_head, sharing)`` normalised as :meth:`AcrossHeadsRMSNorm.forward` does, their
    per-token sums of squares summed over ``group`` in one all-reduce (the queries' and the keys' together: one
    collective per layer and direction instead of two)."""
    size = 1 if group is None else dist.get_world_size(group)
    for norm, x, first_head, sharing in norms:
        norm.check(x, first_head, size, sharing)
    floats = [x.float() for _, x, _, _ in norms]
    # [b, 1, s, 1] each: this rank's share of every token's sum of squares
    squares = [xf.pow(2).sum(dim=(1, 3), keepdim=True) for xf in floats]
    if size > 1:
        squares = list(_all_reduce_sum(torch.cat(squares, dim=-1), group).unbind(dim=-1))
        squares = [sq.unsqueeze(-1) for sq in squares]
    return [norm.scale(xf, sq, first_head, sharing, x.dtype)
            for (norm, x, first_head, sharing), xf, sq in zip(norms, floats, squares)]
