"""Attention over packed rows on one GPU: which kernel keeps each document to itself at the least cost.

Llama-1B-like attention: ``--batch`` 2 rows of ``--seq`` 4096 tokens, 32 query heads over 8 key/value
heads of 64 channels, bf16; each row packs documents of random lengths (uniform in [100, 1100], ~600
on average; the last one cut at the row's end). Forward + backward of attention alone (q, k, v require
grad; the output's gradient is random), median of ``--steps`` after ``--warmup``; peak memory is what the
step allocates above its inputs. Each step takes the next of 8 different document layouts and builds its
masks anew, as a model does per micro-batch (a kernel that recompiled per layout would show here).

- ``causal (reference)``: SDPA's causal flash kernel over the whole row, documents ignored: the cost of
  attention without document masking (wrong for packed rows, the yardstick).
- ``flex``: ``documents.document_attention(kernel="flex")``: compiled FlexAttention with a document-causal
  block mask (built by a compiled ``create_block_mask`` each step, included in the time).
- ``mask``: ``document_attention(kernel="mask")``: SDPA with a boolean ``[b, 1, s, s]`` mask (built each
  step, included), ``enable_gqa``.
- ``mask (kv repeated)``: the same with the key/value heads repeated to 32 (if SDPA's fused kernels refuse
  ``enable_gqa`` with a mask, this is what the mask path would have to do).
- ``nested (varlen)``: SDPA on nested jagged tensors, one sequence per document, ``is_causal`` (flash
  varlen), keys/values repeated per query head; the offsets need the documents' count on the host (a
  sync per step).

``--check`` first compares flex and mask against each document alone (outputs and gradients).

    python benchmarks/bench_packed_attention.py [--seq 4096 --batch 2 --steps 20 --check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_megatron.transformer.documents import DocumentMask, document_attention  # noqa: E402

MiB = 2 ** 20


def document_layouts(count: int, batch: int, seq: int, low: int, high: int, seed: int = 0) -> List[torch.Tensor]:
    """``count`` different ``document_ids [batch, seq]`` (documents of uniform random lengths in [low, high])."""
    gen = torch.Generator().manual_seed(seed)
    layouts = []
    for _ in range(count):
        ids = torch.empty(batch, seq, dtype=torch.long)
        for row in range(batch):
            at, doc = 0, 0
            while at < seq:
                length = min(int(torch.randint(low, high + 1, (), generator=gen)), seq - at)
                ids[row, at:at + length] = doc
                at, doc = at + length, doc + 1
        layouts.append(ids.cuda())
    return layouts


def nested_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One jagged sequence per document (flash varlen through nested tensors), back to ``[b, h, s, d]``."""
    b, h, s, d = q.shape
    flat = ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::s] = True
    offsets = torch.cat([starts.nonzero().flatten(), torch.tensor([b * s], device=q.device)])   # host sync

    def jagged(x: torch.Tensor) -> torch.Tensor:
        x = x.repeat_interleave(h // x.shape[1], dim=1) if x.shape[1] != h else x
        values = x.permute(0, 2, 1, 3).reshape(b * s, h, d)
        return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), is_causal=True)
    return out.transpose(1, 2).values().reshape(b, s, h, d).permute(0, 2, 1, 3)


def kernels(heads: int) -> Dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    def repeated(fn):
        return lambda q, k, v, ids: fn(q, k.repeat_interleave(heads // k.shape[1], 1),
                                       v.repeat_interleave(heads // v.shape[1], 1), ids)

    return {
        "causal (reference)": lambda q, k, v, ids: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                  enable_gqa=True),
        "flex": lambda q, k, v, ids: document_attention(q, k, v, DocumentMask(ids), kernel="flex"),
        "mask": lambda q, k, v, ids: document_attention(q, k, v, DocumentMask(ids), kernel="mask"),
        "mask (kv repeated)": repeated(lambda q, k, v, ids: document_attention(q, k, v, DocumentMask(ids),
                                                                               kernel="mask")),
        "nested (varlen)": nested_attention,
    }


def time_kernel(fn, q, k, v, grad, layouts, warmup: int, steps: int):
    """(median ms of forward+backward, peak MiB above the inputs)."""
    def step(i: int) -> None:
        out = fn(q, k, v, layouts[i % len(layouts)])
        torch.autograd.backward(out, grad)
        q.grad = k.grad = v.grad = None

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(warmup + i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(0)
    torch.cuda.synchronize()
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / MiB


def per_document(q, k, v, ids) -> torch.Tensor:
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        for doc in ids[row].unique():
            at = (ids[row] == doc).nonzero().flatten()
            out[row, :, at] = F.scaled_dot_product_attention(q[row:row + 1, :, at], k[row:row + 1, :, at],
                                                             v[row:row + 1, :, at], is_causal=True,
                                                             enable_gqa=True)[0]
    return out


def check(args, layouts) -> None:
    """flex and mask in bf16 against each document alone in float32: max |difference| of outputs and gradients
    (the float32 model-level comparison is tests/unit/transformer/test_packed_attention.py's GPU test)."""
    for dtype in (torch.bfloat16,):
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(args.batch, args.heads, args.seq, args.head_dim, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(args.batch, args.kv_heads, args.seq, args.head_dim, device="cuda", dtype=dtype,
                            generator=gen) for _ in range(2))
        grad = torch.randn_like(q)
        results = {}
        for name, fn in (("reference", lambda *t: per_document(*t, layouts[0])),
                         ("flex", lambda *t: document_attention(*t, layouts[0], kernel="flex")),
                         ("mask", lambda *t: document_attention(*t, layouts[0], kernel="mask"))):
            inputs = [t.detach().float().to(dtype).requires_grad_() for t in (q, k, v)]
            if name == "reference":   # in float32: the truth
                inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs)
            out.backward(grad.to(out.dtype))
            results[name] = [out.float()] + [t.grad.float() for t in inputs]
        for name in ("flex", "mask"):
            diffs = [(a - b).abs().max().item() for a, b in zip(results[name], results["reference"])]
            print(f"check {str(dtype):15s} {name:5s} max|diff| vs each document alone (fp32): out {diffs[0]:.2e} "
                  f"dq {diffs[1]:.2e} dk {diffs[2]:.2e} dv {diffs[3]:.2e}", flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-doc", type=int, default=100)
    parser.add_argument("--max-doc", type=int, default=1100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", help="kernels to time (default: all)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_packed_attention needs a CUDA GPU.")
    layouts = document_layouts(8, args.batch, args.seq, args.min_doc, args.max_doc)
    docs = [int(ids[row].max()) + 1 for ids in layouts for row in range(args.batch)]
    density = statistics.mean(
        float(sum(int((ids[row] == d).sum()) ** 2 for d in range(int(ids[row].max()) + 1)) / args.seq ** 2)
        for ids in layouts for row in range(args.batch))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; b={args.batch} s={args.seq} "
          f"heads={args.heads} kv_heads={args.kv_heads} d={args.head_dim} bf16; {statistics.mean(docs):.1f} documents "
          f"per row (mean length {args.seq / statistics.mean(docs):.0f}); document-causal work = "
          f"{density:.3f} x causal", flush=True)
    if args.check:
        check(args, layouts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (args.batch, args.heads, args.seq, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    grad = torch.randn_like(q)
    reference_ms = None
    print(f"{'kernel':22s} {'fwd+bwd ms':>10s} {'x causal':>9s} {'peak MiB':>9s}", flush=True)
    for name, fn in kernels(args.heads).items():
        if args.only and name not in args.only:
            continue
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            ms, peak = time_kernel(fn, q, k, v, grad, layouts, args.warmup, args.steps)
        except Exception as error:   # a kernel this torch build lacks: say so, time the others
            print(f"{name:22s} failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}", flush=True)
            torch.cuda.empty_cache()
            continue
        reference_ms = ms if reference_ms is None else reference_ms
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        note = f"  ({compiled} graphs compiled over {min(len(layouts), args.warmup + args.steps + 1)} layouts)" \
            if compiled else ""
        print(f"{name:22s} {ms:10.3f} {ms / reference_ms:9.2f} {peak:9.0f}{note}", flush=True)
    # the block mask alone (built once per model forward, shared by the layers)
    for i in range(3):
        DocumentMask(layouts[i]).block_mask(True, q.device)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(8):
        DocumentMask(layouts[i]).block_mask(True, q.device)
    end.record()
    torch.cuda.synchronize()
    print(f"block mask (compiled create_block_mask): {start.elapsed_time(end) / 8:.3f} ms per forward", flush=True)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        try:
            document_attention(q, k, v, layouts[0], kernel="mask").sum()
            print("mask path: SDPA's memory-efficient kernel takes the boolean mask with enable_gqa", flush=True)
        except RuntimeError as error:
            print(f"mask path: no memory-efficient kernel for mask + enable_gqa ({str(error).splitlines()[0][:120]})",
                  flush=True)


if __name__ == "__main__":
    main()
