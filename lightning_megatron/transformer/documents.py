"""Attention that stays inside each document of a packed row.

A packed row holds several documents back to back (``corpus.PackedDocuments``); ``document_ids [b, s]``
numbers them within the row (0, 1, ...; -1 on padding). A query may see only the keys of its own
document (at or before its position when causal): the block-diagonal "document-causal" mask. Padding
is one more document, so no query row is empty (an all-False row makes SDPA return NaN) and the
labels ignore those tokens anyway.

Kernels (``TransformerConfig.document_attention``), measured by ``benchmarks/bench_packed_attention.py``
(RESULTS.md):

- ``"flex"``: FlexAttention (compiled) with a block mask: it skips the blocks between documents and
  stores nothing of size ``s²``. The block mask is built once per model forward (the
  :class:`DocumentMask` a ``TransformerBlock`` hands to all its layers; ~0.25 ms at s=4096). On an H100
  (Llama-1B attention, 2 x 4096 tokens of ~540-token documents, bf16, forward+backward) it took
  1.6-2.3 ms and 82 MiB, against 4.1 ms and 275 MiB for ``"mask"``, 14 ms for nested-tensor (varlen)
  SDPA, and 1.45 ms for the causal flash kernel over whole rows (wrong here: the yardstick). It has no
  dropout and no CPU backward.
- ``"mask"``: SDPA with a boolean ``[b, 1, s, s]`` mask (kept once per forward and shared by all
  layers, not one per layer). Works everywhere, with dropout; computes the whole ``s²``.
- ``"auto"`` (default): ``"flex"`` for CUDA tensors without attention dropout, ``"mask"`` otherwise: on the
  CPU, when training with ``attention_dropout > 0`` (FlexAttention cannot drop probabilities: falling back
  keeps the configured regularisation at the mask path's cost rather than refusing the run), and for heads
  of fewer than 16 channels (FlexAttention's CUDA kernels need 16).

Under context parallelism the documents' ids are all-gathered with the keys and the load-balanced
chunks use the mask path (``context_parallel.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .config import DOCUMENT_ATTENTION as KERNELS

FLEX_MIN_HEAD_DIM = 16   # FlexAttention's CUDA (Triton) kernels: tl.dot needs at least 16 channels


class DocumentMask:
    """``document_ids [b, s]`` of a packed batch and the masks derived from them, built lazily and once
    per model forward: every layer of a block gets this one object, so the block mask (flex) or the
    ``[b, 1, s, s]`` mask (SDPA, which each layer also keeps for its backward) exists once."""

    def __init__(self, document_ids: torch.Tensor) -> None:
        if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2 \
                or document_ids.is_floating_point() or document_ids.is_complex():
            raise ValueError(f"document_ids must be an integer tensor [batch, sequence] (0, 1, ... per document of a "
                             f"packed row, -1 on padding), got {_describe(document_ids)}.")
        self.ids = document_ids
        self._cache: Dict[Any, Any] = {}

    @staticmethod
    def of(document_ids: Union[torch.Tensor, "DocumentMask"]) -> "DocumentMask":
        return document_ids if isinstance(document_ids, DocumentMask) else DocumentMask(document_ids)

    def check(self, batch: int, seq_len: int) -> None:
        """Raise, naming ``document_ids``, if they are not one id per token of the attention's input."""
        if tuple(self.ids.shape) != (batch, seq_len):
            raise ValueError(
                f"document_ids has shape {tuple(self.ids.shape)} but attention sees {batch} sequences of {seq_len} "
                f"tokens; pass the batch's document_ids [b, s] like input_ids (under context parallelism this "
                f"rank's split_for_context_parallel slice).")

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per key; as ordinary tensors even under ``inference_mode`` (a mask first built in
        validation must not be an inference tensor, which autograd refuses to save when training reuses it)."""
        if key not in self._cache:
            with torch.inference_mode(False):
                self._cache[key] = build()
        return self._cache[key]

    def dense(self, causal: bool, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
        """Boolean ``[b, 1, s, s]``, True where a query may see a key (``window``: a causal sliding window too)."""
        def build() -> torch.Tensor:
            ids = self.ids.to(device)
            keep = ids[:, None, :, None] == ids[:, None, None, :]
            if causal:
                keep = keep & causal_keep(ids.shape[1], window, device)
            return keep
        return self.cached(("dense", causal, window, device), build)

    def block_mask(self, causal: bool, device: torch.device, window: Optional[int] = None) -> Any:
        """FlexAttention's ``BlockMask`` of the document(-causal, windowed) mask, shared by the heads."""
        def build() -> Any:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.ids.to(device)
            b, s = ids.shape

            def mask_mod(batch, head, q_idx, kv_idx):
                keep = ids[batch, q_idx] == ids[batch, kv_idx]
                if causal:
                    keep = keep & (q_idx >= kv_idx)
                if window is not None:
                    keep = keep & (kv_idx > q_idx - window)
                return keep
            make = _compiled("create_block_mask", create_block_mask) if ids.is_cuda else create_block_mask
            return make(mask_mod, b, None, s, s, device=device)
        return self.cached(("block", causal, window, device), build)


def causal_keep(s: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """``[1, 1, s, s]``: key ``j`` visible to query ``i`` iff ``j <= i`` (and ``j > i - window`` with a window)."""
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    return keep[None, None]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


_COMPILED: Dict[str, Callable[..., Any]] = {}


def _compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, made on first use: FlexAttention is a reference loop over ``s²`` scores
    unless compiled, and compiling at import would slow every import."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn)
    return _COMPILED[name]


def choose_kernel(kernel: str, device: torch.device, dropout_p: float, needs_grad: bool, head_dim: int) -> str:
    """``"flex"`` or ``"mask"`` for ``TransformerConfig.document_attention=kernel`` (see the module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"TransformerConfig.document_attention={kernel!r} is not one of {list(KERNELS)}.")
    if kernel == "auto":
        flex = device.type == "cuda" and dropout_p == 0.0 and head_dim >= FLEX_MIN_HEAD_DIM
        return "flex" if flex else "mask"
    if kernel == "flex":
        if device.type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
            raise ValueError(f"TransformerConfig.document_attention='flex' with heads of {head_dim} channels: "
                             f"FlexAttention's CUDA kernels need at least {FLEX_MIN_HEAD_DIM}; use "
                             f"document_attention='auto' or 'mask'.")
        if dropout_p > 0.0:
            raise ValueError(f"TransformerConfig.document_attention='flex' with attention_dropout={dropout_p}: "
                             f"FlexAttention has no dropout; use document_attention='auto' or 'mask' (boolean-mask "
                             f"SDPA, with dropout) or attention_dropout=0.")
        if device.type != "cuda" and needs_grad:
            raise ValueError("TransformerConfig.document_attention='flex' on a CPU cannot train: FlexAttention has no "
                             "CPU backward; use document_attention='auto' or 'mask' there.")
    return kernel


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: Union[torch.Tensor, DocumentMask], causal: bool = True, dropout_p: float = 0.0,
                       attention_mask: Optional[torch.Tensor] = None, kernel: str = "auto") -> torch.Tensor:
    """Attention of ``q [b, heads, s, d]`` over ``k``/``v`` ``[b, kv heads, s, d]`` (grouped-query when
    fewer) within each document of ``documents`` (``document_ids [b, s]`` or their :class:`DocumentMask`).

    ``attention_mask [b, s]`` (1 = token, 0 = padding), if given, also hides those keys (mask path).
    """
    documents = DocumentMask.of(documents)
    b, heads, s = q.shape[0], q.shape[1], q.shape[2]
    documents.check(b, s)
    gqa = k.shape[1] != heads
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    chosen = choose_kernel(kernel, q.device, dropout_p, needs_grad, q.shape[-1])
    if chosen == "flex" and attention_mask is None:
        from torch.nn.attention.flex_attention import flex_attention

        if q.is_cuda:
            flex = _compiled("flex_attention", flex_attention)
        else:   # forward-only (choose_kernel refused training): torch refuses any input that requires grad
            flex, (q, k, v) = flex_attention, (t.detach() for t in (q, k, v))
        return flex(q, k, v, block_mask=documents.block_mask(causal, q.device), enable_gqa=gqa)
    keep = documents.dense(causal, q.device)
    if attention_mask is not None:
        keep = keep & attention_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, enable_gqa=gqa)


def chunk_document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
    """``[b, 1, sq, sk]`` True where query ``i`` (document ``q_ids[:, i]``) and key ``j`` share a document."""
    return q_ids[:, None, :, None] == k_ids[:, None, None, :]


def gathered_ids(documents: DocumentMask,
                 gather: Callable[[torch.Tensor], torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(this rank's ids, the whole sequence's ids) under context parallelism; the gather runs once per
    forward, in the first layer (every cp rank runs the same layers in the same order)."""
    return documents.ids, documents.cached("gathered", lambda: gather(documents.ids))
