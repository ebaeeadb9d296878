"""ECHO expert offloading under skewed routing: an MoE layer with and without spare slots.

EP = the number of GPUs (one rank each, NCCL). Each rank routes ``tokens`` tokens top-k over
``E`` experts; an expert bias (selection only, as aux-loss-free balancing uses it) pushes the
tokens towards EP rank 0's experts, so rank 0 computes more rows than the rest and everyone waits
for it. With ``k`` spare slots per rank, ECHO copies rank 0's busiest experts into the other
ranks' slots and reroutes the excess there. Reported per (skew, k): the rows the busiest rank
computes over the average, the forward+backward time of the layer (median over ranks' wall
clock, all ranks synchronized per step), and expert TFLOP/s per GPU (useful FLOPs only:
``rows · 2·H·F·3`` forward for SwiGLU, ×3 with backward), which is also MFU against 790 TFLOP/s.

    python benchmarks/bench_echo.py [--gpus 2 --iters 20]
    python benchmarks/bench_echo.py --smoke       # tiny sizes, gloo on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lightning_megatron.moe import MoEConfig, MoELayer
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.testing import run_on_ranks

PEAK_TFLOPS = 790.0


def _rows_per_rank(layer: MoELayer, ep: int) -> torch.Tensor:
    columns = layer.dispatcher.num_experts // ep
    rows = layer.dispatcher.meta.routing_map.long().sum(dim=0).view(ep, columns).sum(dim=1)
    dist.all_reduce(rows)
    return rows


def _case(args, skew: float, spare: int, device: torch.device, dtype: torch.dtype):
    ep = dist.get_world_size()
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_experts=args.experts, topk=args.topk,
                    enable_expert_bias=True, num_spare_experts_per_ep_rank=spare,
                    **({} if args.tolerance is None else {"echo_tolerance": args.tolerance}))
    layer = MoELayer(cfg, params_dtype=dtype, device=device)
    with torch.no_grad():
        layer.router.expert_bias[: args.experts // ep] = skew
    gen = torch.Generator(device).manual_seed(1 + dist.get_rank())
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, generator=gen, requires_grad=True)

    def step():
        out = layer(x)
        out.backward(torch.ones_like(out))

    for _ in range(args.warmup):
        step()
    rows = _rows_per_rank(layer, ep)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if args.phases and spare:
        _time_phases(layer, x, args, device)
    if args.profile and dist.get_rank() == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"--- profile: skew {skew}, k={spare}", flush=True)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
        kernels = [e for e in events if e.self_device_time_total > 0]
        print(f"kernels: {sum(e.count for e in kernels)} launches, "
              f"{sum(e.self_device_time_total for e in kernels) / 1e3:.2f} ms GPU", flush=True)
        for e in kernels[:args.profile_rows]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms {e.count:4d}x  {e.key[:90]}", flush=True)
    elif args.profile:
        step()
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)                 # a step is as slow as its slowest rank
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    flops = float(rows.sum()) * 2 * args.hidden * args.ffn * 3 * 3
    return {"skew": skew, "spare": spare, "max/avg rows": float(rows.max() / rows.float().mean()),
            "ms": float(ms), "tflops": flops / ep / (float(ms) * 1e-3) / 1e12, "peak_gib": float(peak)}


def _time_phases(layer: MoELayer, x: torch.Tensor, args, device: torch.device) -> None:
    """Wall-clock ms of ECHO's own pieces, to tell launch overhead from GPU work."""
    from lightning_megatron.moe.spare_weights import weights_with_spare_slots

    local = x.detach().reshape(-1, args.hidden)
    probs, routing_map = layer.route(local)
    _, _, homes = layer.offload(probs, routing_map)
    weights = (layer.experts.weight1, layer.experts.weight2)
    on_host = homes.tolist()   # as the all-to-all dispatcher reads them at its host sync

    def to_slots(host):
        return weights_with_spare_slots(weights, homes, layer.groups.ep, layer.num_spare, homes_on_host=host)

    pieces = {
        "route": lambda: layer.route(local),
        "offload (plan)": lambda: layer.offload(probs, routing_map),
        "weights to slots (static)": lambda: to_slots(None),
        "weights to slots fwd+bwd (static)": lambda: sum(w.sum() for w in to_slots(None)).backward(),
        "weights to slots (used only)": lambda: to_slots(on_host),
        "weights to slots fwd+bwd (used only)": lambda: sum(w.sum() for w in to_slots(on_host)).backward(),
    }
    for name, fn in pieces.items():
        times = []
        for i in range(args.iters + 3):
            torch.cuda.synchronize() if device.type == "cuda" else None
            dist.barrier()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize() if device.type == "cuda" else None
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
        if dist.get_rank() == 0:
            print(f"  phase {name:<38} {statistics.median(times):7.3f} ms", flush=True)
    layer.zero_grad(set_to_none=True)


def _time_unpermute(args, device: torch.device, dtype: torch.dtype) -> None:
    """The combine's weighted sum, forward+backward: float32 copy of the rows first (before) vs regroup in
    the rows' dtype and weight after (``unpermute_per_token``): ms and the memory kept for backward."""
    from lightning_megatron.moe.permute import gather_permutation, unpermute_per_token

    tokens, k = args.tokens, args.topk
    gen = torch.Generator(device).manual_seed(0)
    rows0 = torch.randn(tokens * k, args.hidden, device=device, dtype=dtype, generator=gen)
    probs0 = torch.rand(tokens * k, device=device, generator=gen)
    order = torch.randperm(tokens * k, device=device, generator=gen)
    grad = torch.randn(tokens, args.hidden, device=device, dtype=dtype, generator=gen)

    def before(rows, probs):
        weighted = rows.to(probs.dtype) * probs.unsqueeze(-1)
        return gather_permutation(weighted, order).view(tokens, k, -1).sum(dim=1).to(dtype)

    def after(rows, probs):
        return unpermute_per_token(rows, order, tokens, probs, out_dtype=dtype)

    outs = {}
    for name, fn in (("rows to float32 first", before), ("regroup, then weight", after)):
        rows, probs = rows0.clone().requires_grad_(), probs0.clone().requires_grad_()
        times, kept = [], 0.0
        for i in range(args.iters + 3):
            torch.cuda.synchronize() if device.type == "cuda" else None
            start_mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            out = fn(rows, probs)
            if device.type == "cuda":
                kept = (torch.cuda.memory_allocated(device) - start_mem) / 2**20
            out.backward(grad)
            torch.cuda.synchronize() if device.type == "cuda" else None
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
        outs[name] = (out.detach(), rows.grad, probs.grad)
        if dist.get_rank() == 0:
            print(f"  unpermute {name:<22} fwd+bwd {statistics.median(times):7.3f} ms, kept for backward "
                  f"{kept:8.1f} MiB", flush=True)
    a, b = outs.values()
    if dist.get_rank() == 0:
        print("  unpermute results equal:", all(torch.equal(x, y) for x, y in zip(a, b)), flush=True)


def _run(args):
    rank = dist.get_rank()
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    state = ParallelState(ParallelLayout(dist.get_world_size(), ep=dist.get_world_size())).activate()
    if args.unpermute:
        _time_unpermute(args, device, dtype)
    results = [_case(args, skew, spare, device, dtype) for skew in args.skews for spare in args.spares]
    state.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.2, 0.5, 1.0])
    parser.add_argument("--spares", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tolerance", type=float, default=None,
                        help="MoEConfig.echo_tolerance (default: MoEConfig's; 0: offload every imbalance, as before)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print rank 0's kernel table of one step per case")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--phases", action="store_true", help="time ECHO's pieces on their own")
    parser.add_argument("--unpermute", action="store_true", help="time the combine's weighted sum, before/after")
    args = parser.parse_args()
    if args.smoke:
        args.experts, args.hidden, args.ffn, args.tokens, args.iters, args.warmup = 8, 32, 32, 64, 2, 1
    backend = "nccl" if torch.cuda.is_available() and not args.smoke else "gloo"
    results = run_on_ranks(_run, args.gpus, args, backend=backend, timeout=900)[0]
    name = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
    print(f"ECHO on {args.gpus}x {name}: E={args.experts} H={args.hidden} F={args.ffn} "
          f"tokens/rank={args.tokens} top{args.topk}, SwiGLU, alltoall dispatcher")
    print(f"{'skew':>5} {'spare k':>7} {'max/avg rows':>12} {'fwd+bwd ms':>10} {'TFLOP/s/GPU':>11} {'MFU':>6} "
          f"{'vs k=0':>7} {'peak GiB':>8}")
    base = {}
    for r in results:
        base.setdefault(r["skew"], r["ms"])
        print(f"{r['skew']:>5.1f} {r['spare']:>7d} {r['max/avg rows']:>12.2f} {r['ms']:>10.2f} {r['tflops']:>11.1f} "
              f"{r['tflops'] / PEAK_TFLOPS:>6.1%} {base[r['skew']] / r['ms']:>6.2f}x {r['peak_gib']:>8.2f}")


if __name__ == "__main__":
    main()
