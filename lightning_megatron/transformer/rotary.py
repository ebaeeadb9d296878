"""Rotary position embeddings (RoPE), as Llama and Hugging Face compute them.

Each head's first ``rotary_dim`` channels are rotated in the "rotate half" convention (channel
``i`` pairs with ``i + rotary_dim/2``, not with its neighbour), by angles ``position · inv_freq``;
the remaining channels pass through. ``inv_freq`` is ``base^(-2i/rotary_dim)``, optionally
rescaled (``rope_scaling``: ``"linear"`` divides every frequency by ``factor``, ``"llama3"`` only
the low ones, smoothly, ``"yarn"`` the low ones along a ramp, and scales cos/sin by its attention factor;
``"longrope"`` (Phi-3) divides each frequency by its own ``short_factor``, or ``long_factor`` when the positions
reach past ``original_max_position_embeddings``, and scales cos/sin too; ``"dynamic"`` keeps the default
frequencies up to ``original_max_position_embeddings`` and refuses longer sequences, where transformers would grow
the base with each longer sequence it sees), computed on the CPU in float32 exactly as ``transformers`` does, so an
imported model gives Hugging Face's numbers. LongRoPE chooses per forward as transformers does, by the largest
position: ``position_ids``' (on the device, no host sync) or, without them, the whole sequence's length.

Positions are global token positions. ``SelfAttention`` rotates its queries and keys once it has
the whole (context-parallel local) sequence: under sequence parallelism that is after the
column-parallel all-gather; under context parallelism a rank holds chunks ``r`` and ``2cp-1-r``,
whose positions ``context_parallel_position_ids`` gives, and keys are rotated before they are
gathered, so every rank sees correctly rotated keys of the whole sequence. Explicit
``position_ids`` ``[b, s]`` (this rank's slice, e.g. restarting per packed document) replace them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..context_parallel import context_parallel_position_ids
from ..parallel import get_parallel_state


def rope_inverse_frequencies(rotary_dim: int, base: float = 10000.0,
                             scaling: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32 inverse frequencies on the CPU (Hugging Face's formulas, bit for bit)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "dynamic":
        return inv_freq
    if scaling["rope_type"] == "longrope":
        return _longrope_inverse_frequencies(rotary_dim, base, scaling["short_factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, base, scaling)
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inverse_frequencies(rotary_dim: int, base: float, scaling: Dict[str, Any]) -> torch.Tensor:
    """YaRN (Peng et al. 2023): high frequencies kept, low ones divided by ``factor``, a linear ramp between
    the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original context (transformers'
    formulas and defaults, in the same float32 operations)."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:
        return (rotary_dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp                                                     # 1: the frequency extrapolates as it was
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _longrope_inverse_frequencies(rotary_dim: int, base: float, factors: Any) -> torch.Tensor:
    """``1 / (factor_i * base^(2i/d))``, one factor per frequency (transformers' float32 operations)."""
    factors = torch.tensor(factors, dtype=torch.float32)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"TransformerConfig.rope_scaling of rope_type 'longrope' needs short_factor and long_factor "
                         f"of {rotary_dim // 2} entries (one per rotated frequency), got {tuple(factors.shape)}.")
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (factors * base ** shape)


def rope_attention_factor(scaling: Optional[Dict[str, Any]]) -> float:
    """What cos/sin are multiplied by: YaRN's and LongRoPE's ``attention_factor`` (given, or from ``factor``);
    else 1."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_context))

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
    return mscale_of(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., s, d]`` (heads before ``s``) by ``cos``/``sin`` ``[s, r]`` or ``[b, 1, s, r]``
    (``r <= d``: the first ``r`` channels rotate)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """``forward(seq_len, position_ids=None)`` → ``(cos, sin)`` for queries/keys ``[b, heads, s, d]``.

    Without ``position_ids`` the positions are this context-parallel rank's global ones (cached
    per length: every layer of a step reuses them); with ``position_ids [b, s]`` the result is
    ``[b, 1, s, r]``.
    """

    def __init__(self, rotary_dim: int, base: float = 10000.0, scaling: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # a plain float32 tensor, not a buffer: ``model.to(torch.bfloat16)`` must not round it (``_apply``)
        self.inv_freq = rope_inverse_frequencies(rotary_dim, base, scaling)
        self.attention_factor = rope_attention_factor(scaling)   # YaRN and LongRoPE scale cos and sin; 1 otherwise
        scaling = scaling or {}
        kind = scaling.get("rope_type")
        # LongRoPE: the frequencies past the original context; dynamic: the longest sequence allowed
        self.long_inv_freq = (_longrope_inverse_frequencies(rotary_dim, base, scaling["long_factor"])
                              if kind == "longrope" else None)
        self.original_context: Optional[int] = (scaling["original_max_position_embeddings"]
                                                if kind in ("longrope", "dynamic") else None)
        self.dynamic = kind == "dynamic"
        self._cache: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._move_frequencies(torch.get_default_device())   # a model built under ``with torch.device("cuda")``

    def _apply(self, fn: Any, recurse: bool = True) -> "RotaryEmbedding":
        """Move the frequencies with the module (``.to(device)``, ``.cuda()``, ``to_empty``) but never cast them:
        float32 always."""
        self._move_frequencies(fn(self.inv_freq[:0]).device)   # fn on an empty view: only where it puts a tensor
        return super()._apply(fn, recurse)

    def _move_frequencies(self, device: torch.device) -> None:
        """Keep the frequencies where the module's tensors are: left on the CPU, a compiled layer copies them to the
        GPU at every call, and that copy (from pageable memory) makes the host wait for the GPU's queue. Never to
        ``meta`` (their values are kept for ``to_empty``)."""
        if device.type == "meta":
            return
        self.inv_freq = self.inv_freq.to(device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)
        self._cache = {}

    def _frequencies(self, positions: torch.Tensor, length: Optional[int]) -> torch.Tensor:
        """The inverse frequencies on ``positions``' device; LongRoPE's long ones when the positions reach past the
        original context (``length``: the sequence's, else the largest position's, chosen on the device)."""
        inv_freq = self.inv_freq.to(positions.device)   # already there when the module moved with its model
        long = None if self.long_inv_freq is None else self.long_inv_freq.to(positions.device)
        if long is None:
            return inv_freq
        assert self.original_context is not None   # set with long_inv_freq
        if length is not None:
            return long if length > self.original_context else inv_freq
        return torch.where(positions.max() + 1 > self.original_context, long, inv_freq)

    def _angles(self, positions: torch.Tensor, dtype: torch.dtype,
                length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._frequencies(positions, length)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype,
                position_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        state = get_parallel_state()
        if self.dynamic and seq_len * state.cp_size > self.original_context:
            raise ValueError(f"sequence length {seq_len * state.cp_size} exceeds rope_scaling 'dynamic''s "
                             f"original_max_position_embeddings={self.original_context}: beyond it transformers grows "
                             f"the rotary base with every longer sequence it meets, which is not reproduced here; use "
                             f"shorter sequences or another rope_type.")
        if position_ids is not None:
            if self.long_inv_freq is not None and state.cp_size > 1:
                raise ValueError("rope_scaling of rope_type 'longrope' with position_ids under context parallelism: "
                                 "the choice of factors needs the largest position of the whole sequence; pass no "
                                 "position_ids (global positions) or use context_parallel_size=1.")
            cos, sin = self._angles(position_ids.to(device), dtype)
            return cos.unsqueeze(1), sin.unsqueeze(1)                           # [b, 1, s, r]
        length = seq_len * state.cp_size
        if torch.compiler.is_compiling():
            # a compiled layer computes its angles in its own graph (fused into the rotation): no cache, whose
            # inference-mode check and dict updates would break the graph
            return self._angles(context_parallel_position_ids(seq_len, state.cp_size, state.cp_rank, device), dtype,
                                length)
        # inference-mode tensors cannot be saved for a later training backward: a cache entry of their own
        key = (seq_len, state.cp_size, state.cp_rank, torch.device(device), dtype, torch.is_inference_mode_enabled())
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        positions = context_parallel_position_ids(seq_len, state.cp_size, state.cp_rank, device)
        angles = self._angles(positions, dtype, length)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.compiler.is_compiling():   # a tensor made in a capture is not filled
            self._cache = {key: angles}
        return angles
