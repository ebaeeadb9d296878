"""MoE token permute/unpermute: the torch path vs the fused Triton kernels (``moe/permute_kernels.py``).

One step is what the dispatcher does at ep=1 around the experts: permute the tokens into expert-major
rows, permute the routing probabilities, and un-permute the rows (weighted, float32 sums, back to the
tokens' dtype); forward+backward adds the gradients of tokens, rows and probabilities.

- ``dropless``  top-k rows (``T·k``): ``permute_per_token`` / ``unpermute_per_token``
- ``padded``    capacity factor 1.0, every expert padded to its capacity (``E·capacity`` rows):
                ``permute_indexed`` / ``unpermute``

Times are medians of CUDA-event timings after warm-up, as called (host launch overhead included where the
GPU waits for it) and GPU-only (the host launches a whole step before the start event runs); "x" is torch
time over kernel time; "max err" the largest difference of the forward output between the two paths.

    python benchmarks/bench_moe_permute.py [--tokens 8192 --hidden 4096 --experts 64 --iters 20]
    python benchmarks/bench_moe_permute.py --smoke      # tiny sizes; on the CPU only the torch path runs
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch

from timing import timed   # benchmarks/timing.py (this folder is on sys.path when run as a script)

from lightning_megatron.moe import (
    apply_capacity, expert_capacity, permute_indexed, permute_kernels, permute_per_token, permute_probs, topk_routing,
    unpermute, unpermute_per_token,
)


def make_case(mode: str, tokens: int, experts: int, topk: int, hidden: int, dtype: torch.dtype,
              device: torch.device) -> Dict:
    gen = torch.Generator(device=device).manual_seed(0)
    probs, routing_map = topk_routing(torch.randn(tokens, experts, device=device, generator=gen), topk)
    num_out = tokens * topk
    if mode == "padded":
        capacity = expert_capacity(tokens, experts, topk, 1.0)
        probs, routing_map = apply_capacity(probs, routing_map, capacity, "probs", pad_to_capacity=True)
        num_out = experts * capacity
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype).requires_grad_()
    return dict(mode=mode, topk=topk, x=x, probs=probs.requires_grad_(), routing_map=routing_map, num_out=num_out,
                grad=torch.randn(tokens, hidden, device=device, generator=gen).to(dtype))


def step(case: Dict, backward: bool) -> torch.Tensor:
    x, probs, routing_map, k = case["x"], case["probs"], case["routing_map"], case["topk"]
    num_tokens = x.shape[0]
    if case["mode"] == "dropless":
        rows, slots, order = permute_per_token(x, routing_map, k)
        out = unpermute_per_token(rows, order, num_tokens, permute_probs(probs, slots), out_dtype=x.dtype)
    else:
        rows, slots, token_rows = permute_indexed(x, routing_map, case["num_out"])
        out = unpermute(rows, slots, num_tokens, permute_probs(probs, slots), out_dtype=x.dtype,
                        token_rows=token_rows)
    if backward:
        out.backward(case["grad"])
        x.grad = probs.grad = None
    return out


def run(case: Dict, kernels: bool, iters: int, warmup: int) -> Optional[Dict[str, float]]:
    device = case["x"].device
    if kernels and (device.type != "cuda" or permute_kernels.triton is None):
        return None
    with permute_kernels.kernels_enabled(kernels):
        with torch.no_grad():
            fwd = timed(lambda: step(case, False), iters, warmup, device)
        both = timed(lambda: step(case, True), iters, warmup, device)
        gpu = timed(lambda: step(case, True), iters, 0, device, gpu_only=True) if device.type == "cuda" else both
        with torch.no_grad():
            out = step(case, False)
    return dict(fwd=fwd, both=both, gpu=gpu, out=out)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens (e.g. mb4 x s2048)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--modes", nargs="+", default=["dropless", "padded"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (runs on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.iters, args.warmup = [64], 32, 8, 2, 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {str(dtype).replace('torch.', '')}, "
          f"E={args.experts}, H={args.hidden}")
    header = ("case", "rows", "torch fwd", "kern fwd", "x", "torch f+b", "kern f+b", "x", "torch f+b GPU",
              "kern f+b GPU", "x", "max err")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for tokens in args.tokens:
        for topk in args.topk:
            for mode in args.modes:
                case = make_case(mode, tokens, args.experts, topk, args.hidden, dtype, device)
                ref = run(case, False, args.iters, args.warmup)
                ker = run(case, True, args.iters, args.warmup)
                label = f"T{tokens} top{topk} {mode}"
                if ker is None:
                    cells = [f"{ref['fwd']:.3f}", "n/a", "", f"{ref['both']:.3f}", "n/a", "", "", "", "", ""]
                else:
                    err = (ker["out"].float() - ref["out"].float()).abs().max().item()
                    cells = [f"{ref[key]:.3f}" if i == 0 else (f"{ker[key]:.3f}" if i == 1 else
                                                               f"{ref[key] / ker[key]:.2f}")
                             for key in ("fwd", "both", "gpu") for i in range(3)] + [f"{err:.2e}"]
                print("| " + " | ".join([label, str(case["num_out"])] + cells) + " |")
                del case
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("(times in ms; x = torch / kernels; GPU: host launch overhead hidden behind a queued GPU sleep)")


if __name__ == "__main__":
    main()
