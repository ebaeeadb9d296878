"""Does a tensor-parallel collective overlap the GEMM beside it? The backward of a column-parallel linear under
sequence parallelism at TP2, at the Llama-3-8B layer shape (issue 30/32).

``tensor_parallel/column_backward.py`` launches the input gradient's reduce-scatter asynchronously and computes the
weight gradient while it travels, yet the profiled TP2 step's kernels add up to its wall time (benchmarks/RESULTS.md,
tenth session): the overlap seems not to happen. A likely cause: cuBLAS's persistent GEMM kernels take every SM, so
NCCL's kernel, ready at the same moment, starts only when the GEMM ends. This times, per rank, with CUDA events, the
median of ``--iters`` after warm-up:

- ``dgrad`` / ``wgrad``: the input- / weight-gradient GEMM alone; ``rs`` / ``ag``: the collective alone;
- ``serial``: input-gradient GEMM, the collective (waited for), the weight-gradient GEMM, as eager autograd runs them;
- ``overlap``: the same with the collective asynchronous, the weight-gradient GEMM beside it, then the wait (what
  column_backward.py does); ``overlap-carveout-N``: the weight-gradient GEMM told to leave N SMs free
  (``torch._C._set_sm_carveout_experimental``, where this torch has it);
- ``ag+wgrad`` (and ``-carveout-N``): an all-gather beside a weight-gradient GEMM, as a row-parallel linear's
  gradient all-gather would run if the weight gradient before it were deferred by one collective (to compare with
  ``ag`` + ``wgrad``);
- ``lc-*``: the reduce-scatter and all-gather through symmetric memory's low-contention ops (copy engines, not
  SMs, move the data), alone and beside the weight-gradient GEMM (CUDA, where this torch has them).

Launch it once per environment to compare ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-LM's setting for its overlap)
or ``NCCL_MAX_CTAS`` against the default:

    torchrun --nproc_per_node=2 benchmarks/bench_tp_overlap.py [--carveouts 8 16 32]
    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node=2 benchmarks/bench_tp_overlap.py
    torchrun --nproc_per_node=2 benchmarks/bench_tp_overlap.py --cpu     # gloo, tiny shapes: the script's plumbing

Prints one JSON line per case from rank 0 (``{"case", "ms", "env"}``), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of a micro-batch (2 x 4096)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336, help="the MLP's hidden size (gate and up: 2x, split by tp)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--carveouts", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32 (plumbing only)")
    return parser.parse_args()


def timed(fn: Callable[[], None], iters: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls (each bracketed by barriers, so both ranks start
    together)."""
    import time

    samples: List[float] = []
    for i in range(warmup + iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            samples.append(ms)
    return statistics.median(samples)


def cases(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Dict[str, Callable[[], None]]:
    """The column-parallel fc1's backward (gate and up fused) on this rank: ``grad`` ``[T, 2F/tp]``, the gathered
    input ``total`` ``[T, H]``, the weight shard ``[2F/tp, H]``; the input gradient ``[T, H]`` is reduce-scattered
    to ``[T/tp, H]``."""
    tp = dist.get_world_size()
    gen = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    rows = 2 * args.ffn // tp
    grad = torch.randn(args.tokens, rows, generator=gen).to(device, dtype)
    total = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    weight = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    partial = torch.empty(args.tokens, args.hidden, device=device, dtype=dtype)
    shard = torch.empty(args.tokens // tp, args.hidden, device=device, dtype=dtype)
    weight_grad = torch.empty(rows, args.hidden, device=device, dtype=dtype)

    def dgrad() -> None:
        torch.mm(grad, weight, out=partial)

    def wgrad() -> None:
        torch.mm(grad.t(), total, out=weight_grad)

    def reduce_scatter(async_op: bool = False) -> Optional[dist.Work]:
        return dist.reduce_scatter_tensor(shard, partial, async_op=async_op)

    def reduce_scatter_alone() -> None:
        reduce_scatter()

    def all_gather(async_op: bool = False) -> Optional[dist.Work]:
        return dist.all_gather_into_tensor(partial, shard, async_op=async_op)

    def all_gather_alone() -> None:
        all_gather()

    def serial() -> None:
        dgrad()
        reduce_scatter()
        wgrad()

    def beside_wgrad(collective: Callable[..., Optional[dist.Work]], first: Optional[Callable[[], None]] = None,
                     carveout: Optional[int] = None) -> Callable[[], None]:
        """``first()``, then ``collective`` launched asynchronously with the weight-gradient GEMM beside it (leaving
        ``carveout`` SMs free), then the wait."""
        def run() -> None:
            if first is not None:
                first()
            work = collective(async_op=True)
            if carveout is not None:
                torch._C._set_sm_carveout_experimental(carveout)
            wgrad()
            if carveout is not None:
                torch._C._set_sm_carveout_experimental(None)
            assert work is not None
            work.wait()
        return run

    def overlap(carveout: Optional[int] = None) -> Callable[[], None]:
        """column_backward.py's order: the input-gradient GEMM, its reduce-scatter beside the weight gradient."""
        return beside_wgrad(reduce_scatter, dgrad, carveout)

    def ag_beside_wgrad(carveout: Optional[int] = None) -> Callable[[], None]:
        """A row-parallel linear's gradient all-gather beside another linear's weight-gradient GEMM (what deferring
        that GEMM by one collective would give)."""
        return beside_wgrad(all_gather, None, carveout)

    out: Dict[str, Callable[[], None]] = {"dgrad": dgrad, "wgrad": wgrad, "rs": reduce_scatter_alone,
                                          "ag": all_gather_alone, "serial": serial, "overlap": overlap(),
                                          "ag+wgrad": ag_beside_wgrad()}
    if device.type == "cuda" and hasattr(torch._C, "_set_sm_carveout_experimental"):
        for n in args.carveouts:
            out[f"overlap-carveout-{n}"] = overlap(n)
            out[f"ag+wgrad-carveout-{n}"] = ag_beside_wgrad(n)
    try:   # last: symmetric memory may be refused where it is not set up
        out.update(low_contention_cases(partial, shard, dgrad, wgrad, device))
    except (RuntimeError, ValueError) as error:
        if dist.get_rank() == 0:
            print(f"(symmetric memory's low-contention ops unavailable: {error})", flush=True)
    return out


def low_contention_cases(partial: torch.Tensor, shard: torch.Tensor, dgrad: Callable[[], None],
                         wgrad: Callable[[], None], device: torch.device) -> Dict[str, Callable[[], None]]:
    """The same collectives through symmetric memory's low-contention ops (copy engines move the data, so the
    GEMM keeps its SMs; the reduce-scatter's sum is one small kernel), where this torch has them on CUDA."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return {}
    if device.type != "cuda" or not hasattr(symm_mem, "_low_contention_reduce_scatter"):
        return {}
    name = dist.group.WORLD.group_name
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        symm_mem.enable_symm_mem_for_group(name)
    ops = torch.ops.symm_mem
    wait = torch.ops._c10d_functional.wait_tensor

    def rs_alone() -> None:
        wait(ops._low_contention_reduce_scatter(partial, "sum", name))

    def ag_alone() -> None:
        wait(ops._low_contention_all_gather(shard, name))

    def rs_overlap() -> None:
        dgrad()
        out = ops._low_contention_reduce_scatter(partial, "sum", name)
        wgrad()
        wait(out)

    def ag_beside() -> None:
        out = ops._low_contention_all_gather(shard, name)
        wgrad()
        wait(out)

    return {"lc-rs": rs_alone, "lc-ag": ag_alone, "lc-overlap": rs_overlap, "lc-ag+wgrad": ag_beside}


def main() -> None:
    args = parse()
    cuda = not args.cpu and torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    env = {k: os.environ[k] for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS")
           if k in os.environ}
    results = {}
    plain = cases(args, device, dtype)
    for name, fn in plain.items():   # each line as soon as it is measured: a later case that fails keeps them
        results[name] = timed(fn, args.iters, args.warmup, cuda)
        if rank == 0:
            print(json.dumps({"case": name, "ms": round(results[name], 4), "env": env}), flush=True)
    if rank == 0:
        ideal = results["dgrad"] + max(results["rs"], results["wgrad"])
        print(f"\nTP{dist.get_world_size()} column-parallel backward, T={args.tokens} H={args.hidden} "
              f"2F/tp={2 * args.ffn // dist.get_world_size()}, env {env or 'default'}")
        print("| case | ms | vs serial |\n|---|---|---|")
        for name, ms in results.items():
            print(f"| {name} | {ms:.3f} | {ms / results['serial']:.3f} |")
        print(f"| (ideal overlap: dgrad + max(wgrad, rs)) | {ideal:.3f} | {ideal / results['serial']:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
