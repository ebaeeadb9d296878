"""Where the time of ``GroupedMLP``'s forward+backward goes, bf16 ``grouped_mm`` vs float8 grouped experts:
GPU time per kernel family (GEMMs, float8 casts, the aligned-layout copies, the rest) from torch.profiler.

    python benchmarks/profile_grouped_experts.py [--experts 64 --hidden 4096 --ffn 2048 --rows 65536]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from timing import gpu_kernels   # benchmarks/timing.py (this folder is on sys.path when run as a script)

from lightning_megatron.quantization.float8 import Float8GroupedMatmul
from lightning_megatron.moe import GroupedMLP


def family(name: str) -> str:
    lowered = name.lower()
    if "gemm" in lowered or "cutlass" in lowered or "sm90" in lowered or "nvjet" in lowered or "xmma" in lowered:
        return "GEMM"
    if "fp8" in lowered or "float8" in lowered or "scale" in lowered or "amax" in lowered or "triton" in lowered:
        return "float8 casts / scales (Triton)"
    if "index" in lowered or "scatter" in lowered or "gather" in lowered:
        return "aligned layout (index copy / select)"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    mlp = GroupedMLP(args.experts, args.hidden, args.ffn, params_dtype=torch.bfloat16, device="cuda",
                     perform_initialization=False, backend="grouped_mm")
    with torch.no_grad():
        for w in mlp.parameters():
            w.normal_(0.0, 0.02)
    counts = torch.bincount(torch.randint(0, args.experts, (args.rows,)), minlength=args.experts).cuda()
    x = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {args.experts} experts, hidden {args.hidden}, "
          f"ffn {args.ffn}, {args.rows} rows (SwiGLU)")
    for name, fn in (("bf16 grouped_mm", None), ("float8 grouped", Float8GroupedMatmul("profile"))):
        mlp.float8 = fn
        for _ in range(3):
            mlp(x, counts).backward(grad)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                mlp(x, counts).backward(grad)
            torch.cuda.synchronize()
        totals, kernels = defaultdict(float), defaultdict(float)
        for kernel, start, stop in gpu_kernels(prof):
            ms = (stop - start) / 1e3 / args.iters
            totals[family(kernel)] += ms
            kernels[kernel[:90]] += ms
        print(f"\n{name}: {sum(totals.values()):.2f} ms GPU per forward+backward")
        for fam, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {fam:<40} {ms:7.2f} ms")
        for kernel, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {ms:7.3f} ms  {kernel}")


if __name__ == "__main__":
    main()
