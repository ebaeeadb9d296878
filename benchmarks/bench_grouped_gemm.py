"""Expert MLPs: one grouped GEMM over all local experts vs a matmul loop per expert.

The routed rows (``tokens · topk``) are spread over the experts uniformly or skewed (Zipf, s=1),
and each variant runs ``GroupedMLP`` (SwiGLU, bf16) forward and forward+backward:

- ``grouped_mm``   torch._grouped_mm with the per-expert counts as device offsets (no sync)
- ``loop``         one F.linear pair per expert, counts already on the host (no sync; the
                   best a loop can do)
- ``loop+sync``    the same loop fed device counts: one ``.tolist()`` per call, what a dispatcher
                   that keeps its counts on the GPU pays for a loop
- ``fp8``          ``enable_fp8``'s float8 grouped experts (torchao's row-wise float8 grouped GEMM on rows
                   laid out in 16-aligned groups; Hopper + torchao); "max err" is then float8's error

FLOPs = 2·rows·H·F·(2+1) forward (SwiGLU fc1 is 2F wide), 3× that forward+backward. Times are
medians of CUDA-event timings after warm-up; "vs loop" is the loop's forward+backward time over
the variant's; "max err" the forward's largest difference from the first variant (``grouped_mm``, bf16).

    python benchmarks/bench_grouped_gemm.py [--iters 30 --warmup 5]
    python benchmarks/bench_grouped_gemm.py --smoke      # tiny sizes; also runs on the CPU
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

import torch

from timing import timed   # benchmarks/timing.py (this folder is on sys.path when run as a script)

from lightning_megatron.moe import GroupedMLP, grouped_mm_available

# (name, experts, hidden, ffn per expert, tokens, topk)
CONFIGS = [
    ("DeepSeek-V2-Lite-like", 64, 2048, 1408, 4096, 6),
    ("64 experts, H4096", 64, 4096, 2048, 8192, 8),
    ("Mixtral-like, 8 experts", 8, 4096, 14336, 4096, 2),
]
SMOKE = [("smoke", 8, 64, 32, 64, 2)]


def token_counts(rows: int, experts: int, skew: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.ones(experts) if skew == "uniform" else 1.0 / torch.arange(1, experts + 1).float()
    picks = torch.multinomial(weights / weights.sum(), rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts)


def float8_grouped_available() -> bool:
    try:
        import torchao.prototype.moe_training  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


def bench_config(name: str, experts: int, hidden: int, ffn: int, tokens: int, topk: int, skew: str,
                 args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> List[Dict[str, object]]:
    torch.manual_seed(0)
    mlp = GroupedMLP(experts, hidden, ffn, activation="swiglu", params_dtype=dtype, device=device,
                     perform_initialization=False)    # the CPU master draws are slow at these sizes
    with torch.no_grad():
        for weight in mlp.parameters():
            weight.normal_(0.0, 0.02)
    rows = tokens * topk
    counts_host = token_counts(rows, experts, skew)
    counts_dev = counts_host.to(device)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, hidden, device=device, dtype=dtype)
    variants: List[Tuple[str, torch.Tensor]] = [("loop", counts_host), ("loop+sync", counts_dev)]
    if grouped_mm_available(device, dtype):
        variants.insert(0, ("grouped_mm", counts_dev))
        if float8_grouped_available():
            variants.insert(1, ("fp8", counts_dev))
    flops = 2 * rows * hidden * ffn * 3
    results, reference = [], None
    for impl, counts in variants:
        mlp.backend = "grouped_mm" if impl in ("grouped_mm", "fp8") else "loop"
        if impl == "fp8":
            from lightning_megatron.quantization.float8 import Float8GroupedMatmul

            mlp.float8 = Float8GroupedMatmul("bench")
        else:
            mlp.float8 = None
        with torch.no_grad():
            out = mlp(x, counts)
        if reference is None:
            reference = out.float()
        err = (out.float() - reference).abs().max().item()

        def forward() -> None:
            with torch.no_grad():
                mlp(x, counts)

        def forward_backward() -> None:
            mlp(x, counts).backward(grad)

        fwd = timed(forward, args.iters, args.warmup, device)
        fwd_bwd = timed(forward_backward, args.iters, args.warmup, device)
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        results.append(dict(config=name, skew=skew, impl=impl, experts=experts, rows=rows, fwd=fwd,
                            fwd_tflops=flops / fwd / 1e9, fwd_bwd=fwd_bwd,
                            fwd_bwd_tflops=3 * flops / fwd_bwd / 1e9, max_count=int(counts_host.max()), err=err))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the script)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    configs = SMOKE if args.smoke else CONFIGS
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__}), "
              f"grouped_mm available: {grouped_mm_available(device, dtype)}")
    else:
        print(f"device: CPU (torch {torch.__version__}); timings are not meaningful")
    rows = []
    for config in configs:
        for skew in ("uniform", "zipf"):
            rows += bench_config(*config, skew, args, device, dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    header = (f"| {'config':<24} | {'tokens→experts':<14} | {'impl':<10} | {'rows':>6} | {'max/expert':>10} "
              f"| {'fwd ms':>7} | {'TFLOP/s':>7} | {'fwd+bwd ms':>10} | {'TFLOP/s':>7} | {'vs loop':>7} "
              f"| {'max err':>8} |")
    print()
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    loop_ms = {(r["config"], r["skew"]): r["fwd_bwd"] for r in rows if r["impl"] == "loop"}
    for r in rows:
        speedup = loop_ms[(r["config"], r["skew"])] / r["fwd_bwd"]
        print(f"| {r['config']:<24} | {r['skew']:<14} | {r['impl']:<10} | {r['rows']:>6} | {r['max_count']:>10} | "
              f"{r['fwd']:>7.3f} | {r['fwd_tflops']:>7.1f} | {r['fwd_bwd']:>10.3f} | {r['fwd_bwd_tflops']:>7.1f} | "
              f"{speedup:>6.2f}x | {r['err']:>8.1e} |")


if __name__ == "__main__":
    main()
