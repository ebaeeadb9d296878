"""Sliding-window and soft-capped attention on a GPU: ``variant_attention``'s FlexAttention kernel against its
mask kernel (SDPA with a boolean keep-mask, or explicit float32 math when the scores are capped), and plain
causal SDPA (cuDNN/flash, no window or cap: the floor), forward + backward, bf16 (issue #29: the kernel
"chosen by measurement").

Shapes: Gemma-2-2B's attention (8 query heads, 4 kv heads, head_dim 256, window 4096, cap 50, sequence 8192),
Gemma-2-9B's (16/8 heads), and a Mistral-7B-like window without a cap (32/8 heads, head_dim 128, window 4096,
sequence 8192): the mask kernel there is SDPA with a mask, the cap-free case.

    python benchmarks/bench_window_attention.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lightning_megatron.transformer.score_attention import variant_attention

SHAPES = {
    "gemma2-2b": dict(b=1, heads=8, kv=4, s=8192, d=256, window=4096, softcap=50.0),
    "gemma2-9b": dict(b=1, heads=16, kv=8, s=8192, d=256, window=4096, softcap=50.0),
    "mistral-7b": dict(b=1, heads=32, kv=8, s=8192, d=128, window=4096, softcap=None),
    "gemma3-local": dict(b=1, heads=8, kv=4, s=8192, d=256, window=1024, softcap=None),
}


def inputs(shape: dict):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, s, d = shape["b"], shape["heads"], shape["kv"], shape["s"], shape["d"]
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    upstream = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)], upstream


def run(fn, q, k, v, upstream):
    out = fn(q, k, v)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), upstream))


def timed(fn, q, k, v, upstream, reps: int = 10) -> float:
    run(fn, q, k, v, upstream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run(fn, q, k, v, upstream)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    print("| shape | kernel | fwd+bwd ms | max rel. diff vs mask kernel | peak GiB |\n|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        (q, k, v), upstream = inputs(shape)
        variant = dict(window=shape["window"], softcap=shape["softcap"])
        kernels = {
            "mask": lambda q, k, v: variant_attention(q, k, v, kernel="mask", **variant),
            "flex": lambda q, k, v: variant_attention(q, k, v, kernel="flex", **variant),
            "plain causal SDPA (no window/cap)": lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True),
        }
        reference = None
        for kernel, fn in kernels.items():
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                ms = timed(fn, q, k, v, upstream)
            except Exception as err:   # report and go on: one kernel failing must not hide the others
                print(f"| {name} | {kernel} | FAILED: {type(err).__name__}: {str(err).splitlines()[0][:150]} | | |",
                      flush=True)
                continue
            result = run(fn, q, k, v, upstream)
            if kernel == "mask":
                reference = result
            diff = "-" if reference is None or kernel.startswith("plain") else max(
                ((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
                for a, r in zip(result, reference))
            diff = diff if isinstance(diff, str) else f"{diff:.1e}"
            print(f"| {name} | {kernel} | {ms:.2f} | {diff} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |"
                  f"  (first call incl. compile {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
