"""Attention with the score variants of Gemma-2/Gemma-3, Mistral and OLMo-3: a causal sliding window, tanh
soft-capping of the scores and a custom softmax scale.

``F.scaled_dot_product_attention(is_causal=True)`` expresses none of the window or the cap, so
:func:`variant_attention` combines them with the usual options (causal or not, a padding mask, packed
documents, grouped-query attention, dropout). Its result is Hugging Face's Gemma-2 eager attention
(``eager_attention_forward`` with ``masking_utils``' masks): ``scores = q @ k^T * scale``, then
``softcap * tanh(scores / softcap)``, then the mask (key ``j`` visible to query ``i`` iff ``j <= i`` and
``j > i - window``, in the query's document, not padding), softmax in float32 cast back to the query dtype,
dropout, ``@ v``. A query with no visible key at all (left padding) gets zeros, as SDPA and FlexAttention give,
never NaN.

Kernels (``kernel``, the values and rules of ``documents.choose_kernel``):

- ``"flex"``: FlexAttention (compiled on CUDA) with a block mask of causal/window/documents, which skips the
  blocks outside the window and between documents, and a ``score_mod`` for the cap. Block masks are built once
  and shared by the layers: on the :class:`DocumentMask` (one per model forward) or, without documents, in a
  small module-level cache. Forward only on a CPU; no dropout. A padding mask takes the mask path, as in
  ``documents.py``.
- ``"mask"``: SDPA with a boolean ``[b or 1, 1, s, s]`` keep-mask when there is no cap (its fused kernels,
  ``is_causal`` when only causal), explicit math otherwise. Works everywhere, with dropout; computes all ``s²``.
- ``"auto"``: ``"flex"`` on CUDA without dropout and for heads of at least 16 channels, ``"mask"`` otherwise;
  and ``"mask"`` for plain attention (no window, cap or documents), whose flash kernel is the fastest.

Dropout's random state is the caller's (it wraps the call in its RNG fork), as for ``document_attention``.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .documents import DocumentMask, _compiled, causal_keep, choose_kernel

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

CACHE_SIZE = 8   # masks kept without documents: (causal, window, s, device) of the model's few shapes
_MASKS: "collections.OrderedDict[Tuple[Any, ...], Any]" = collections.OrderedDict()
_SCORE_MODS: Dict[float, ScoreMod] = {}


def variant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      dropout_p: float = 0.0, scale: Optional[float] = None, softcap: Optional[float] = None,
                      window: Optional[int] = None, attention_mask: Optional[torch.Tensor] = None,
                      documents: Union[torch.Tensor, DocumentMask, None] = None, kernel: str = "auto") -> torch.Tensor:
    """Attention of ``q [b, H, s, d]`` over ``k``/``v`` ``[b, G, s, d]`` (query head ``h`` uses kv head
    ``h // (H/G)``) with a sliding ``window`` (causal only), score ``softcap`` and ``scale`` (default ``d**-0.5``):
    the score variants plain SDPA cannot express. ``attention_mask [b, s]`` (1 = token, 0 = padding) hides
    padded keys; ``documents`` (``document_ids [b, s]`` or their :class:`DocumentMask`) keeps each query inside
    its document. Returns ``[b, H, s, d]``."""
    check_variant(q, k, v, causal=causal, dropout_p=dropout_p, scale=scale, softcap=softcap, window=window,
                  attention_mask=attention_mask)
    b, s = q.shape[0], q.shape[2]
    docs = None if documents is None else DocumentMask.of(documents)
    if docs is not None:
        docs.check(b, s)
    if window is not None and window >= s:   # the window hides nothing: plain causal (and SDPA's fused kernels)
        window = None
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    plain = window is None and softcap is None and docs is None
    chosen = pick_kernel(kernel, q.device, dropout_p, needs_grad, q.shape[-1], plain)
    if chosen == "flex" and attention_mask is None:
        return _flex_path(q, k, v, causal=causal, scale=scale, softcap=softcap, window=window, documents=docs)
    return _mask_path(q, k, v, causal=causal, dropout_p=dropout_p, scale=scale, softcap=softcap, window=window,
                      attention_mask=attention_mask, documents=docs)


def check_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, dropout_p: float,
                  scale: Optional[float], softcap: Optional[float], window: Optional[int],
                  attention_mask: Optional[torch.Tensor]) -> None:
    """Raise ValueError, naming the parameter and the fix, for arguments the kernels would misread."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [b, heads, s, d] and k, v both [b, kv heads, s, d]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}.")
    (b, heads, s, d), groups = q.shape, k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d) or groups < 1 or heads % groups:
        raise ValueError(f"k/v of shape {tuple(k.shape)} do not fit q of shape {tuple(q.shape)}: they need the same "
                         f"batch, sequence and head_dim, and a number of kv heads that divides the {heads} query "
                         f"heads (grouped-query attention).")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window (sliding_window) must be a positive number of tokens or None, got {window!r}.")
        if not causal:
            raise ValueError(f"sliding_window={window} with non-causal attention: the window is only defined for "
                             f"causal attention here; use sliding_window=None or a causal mask.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap (attention logit soft-capping) must be a positive number or None, got {softcap!r}.")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale (the softmax scale, default head_dim ** -0.5) must be positive or None, got "
                         f"{scale!r}.")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p (attention_dropout) must be in [0, 1), got {dropout_p!r}.")
    if attention_mask is not None and tuple(attention_mask.shape) != (b, s):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but attention sees {b} sequences "
                         f"of {s} tokens; pass it [b, s] with 1 on tokens and 0 on padding.")


def pick_kernel(kernel: str, device: torch.device, dropout_p: float, needs_grad: bool, head_dim: int,
                plain: bool) -> str:
    """``"flex"`` or ``"mask"``: ``documents.choose_kernel``'s rules, except that ``"auto"`` leaves plain
    attention (no window, cap or documents) to SDPA, whose fused kernels beat FlexAttention there."""
    chosen = choose_kernel(kernel, device, dropout_p, needs_grad, head_dim)
    return "mask" if kernel == "auto" and plain else chosen


# ---------------------------------------------------------------- the mask path


def _mask_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, dropout_p: float,
               scale: Optional[float], softcap: Optional[float], window: Optional[int],
               attention_mask: Optional[torch.Tensor], documents: Optional[DocumentMask]) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    if softcap is None and causal and window is None and attention_mask is None and documents is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    keep = keep_mask(q.shape[2], q.device, causal=causal, window=window, attention_mask=attention_mask,
                     documents=documents)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    return explicit_attention(q, k, v, keep, scale=scale, softcap=softcap, dropout_p=dropout_p)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor], *,
                       scale: Optional[float], softcap: Optional[float], dropout_p: float) -> torch.Tensor:
    """The scores spelled out (no fused kernel caps them): matmul, cap, mask, float32 softmax, dropout, matmul.
    Rows of ``keep`` with no visible key give zeros (a finite fill keeps their softmax and gradients NaN-free)."""
    b, heads, s, d = q.shape
    groups = k.shape[1]
    if groups != heads:   # query head h reads kv head h // (heads / groups)
        k, v = (t[:, :, None].expand(b, groups, heads // groups, s, d).reshape(b, heads, s, d) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs, v)
    if keep is not None:
        out = out.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    return out


def keep_mask(s: int, device: torch.device, *, causal: bool, window: Optional[int],
              attention_mask: Optional[torch.Tensor], documents: Optional[DocumentMask]) -> Optional[torch.Tensor]:
    """Boolean ``[b or 1, 1, s, s]`` (or broadcastable), True where a query may see a key; None: all visible.
    Built once per forward and shared by the layers (SDPA keeps each layer's mask for its backward)."""
    if documents is not None:   # the DocumentMask's own mask (one per forward, shared by the layers)
        structural: Optional[torch.Tensor] = documents.dense(causal, device, window)
    else:
        structural = None if not causal else _lru(("dense", window, s, device), lambda: causal_keep(s, window, device))
    if attention_mask is None:
        return structural
    padded = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return padded if structural is None else structural & padded


# ---------------------------------------------------------------- the flex path


def _flex_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: Optional[float],
               softcap: Optional[float], window: Optional[int], documents: Optional[DocumentMask]) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = flex_block_mask(q.shape[2], q.device, causal=causal, window=window, documents=documents)
    if q.is_cuda:
        flex = _compiled("flex_attention", flex_attention)
    else:   # forward-only (choose_kernel refused training): torch refuses any input that requires grad
        flex, (q, k, v) = flex_attention, (t.detach() for t in (q, k, v))
    return flex(q, k, v, score_mod=softcap_mod(softcap), block_mask=block_mask, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1])


def flex_block_mask(s: int, device: torch.device, *, causal: bool, window: Optional[int],
                    documents: Optional[DocumentMask]) -> Any:
    """FlexAttention's ``BlockMask`` of causal/window/documents (None: nothing masked), built once: on the
    ``DocumentMask`` with documents, else in the module's small cache."""
    if documents is not None:
        return documents.block_mask(causal, device, window)
    if not causal:
        return None
    return _lru(("block", window, s, device), lambda: _causal_block_mask(s, device, window))


def _causal_block_mask(s: int, device: torch.device, window: Optional[int]) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = kv_idx <= q_idx
        return keep if window is None else keep & (kv_idx > q_idx - window)
    make = _compiled("create_block_mask", create_block_mask) if device.type == "cuda" else create_block_mask
    return make(mask_mod, None, None, s, s, device=device)


def softcap_mod(softcap: Optional[float]) -> Optional[ScoreMod]:
    """``score_mod`` of ``softcap * tanh(score / softcap)`` (FlexAttention scales before it), one function per
    value so the compiled kernel is reused rather than recompiled for a new closure."""
    if softcap is None:
        return None
    if softcap not in _SCORE_MODS:
        cap = float(softcap)

        def score_mod(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:
            return torch.tanh(score / cap) * cap
        _SCORE_MODS[softcap] = score_mod
    return _SCORE_MODS[softcap]


# ---------------------------------------------------------------- the cache without documents


def _lru(key: Tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """``build()`` kept under ``key`` among the last ``CACHE_SIZE``."""
    if key in _MASKS:
        _MASKS.move_to_end(key)
    else:
        _MASKS[key] = _outside_inference(build)
        while len(_MASKS) > CACHE_SIZE:
            _MASKS.popitem(last=False)
    return _MASKS[key]


def _outside_inference(build: Callable[[], Any]) -> Any:
    """``build()`` as ordinary tensors even under ``inference_mode`` (validation): a mask kept for later use must
    not be an inference tensor, which autograd refuses to save when training reuses it."""
    with torch.inference_mode(False):
        return build()
