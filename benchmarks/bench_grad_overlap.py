"""Data-parallel GPT step on 2 GPUs: gradient reduction after the backward vs overlapped with it,
for the all-reduce (plain optimizer) and the reduce-scatter + all-gather (distributed optimizer).

One launch, five rows, each a fresh model built from the same seed: forward + backward + gradient
reduction + AdamW step, median of ``--steps`` steps after ``--warmup``, timed with CUDA events.

1. compute only: the same buffers and step with no data-parallel group (no communication) — the
   floor that overlap can at best reach;
2. all-reduce after the backward (``overlap_grad_reduce=False``: one bucket, the current default);
3. all-reduce overlapped (``overlap_grad_reduce=True``, buckets of ``--bucket-size`` elements);
4. distributed optimizer, reduce-scatter + all-gather after the backward / step;
5. distributed optimizer, both overlapped (``overlap_grad_reduce`` + ``overlap_param_gather``).

"exposed comm" is a row's step time minus row 1's: the communication the backward did not hide.
The default model (~0.5B parameters, fp32 master weights under bf16 autocast, so 2 GB of fp32
gradients per step) is sized so that its reduction is a visible share of the step on NVLink.

    torchrun --nproc_per_node=2 benchmarks/bench_grad_overlap.py [--hidden 2048 --layers 8 --seq 1024]
    torchrun --nproc_per_node=2 benchmarks/bench_grad_overlap.py --cpu      # a gloo smoke run, tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_megatron.distributed import (DataParallelGrads, DistributedOptimizer,  # noqa: E402
                                            finalize_model_grads)
from lightning_megatron.models import GPTModel  # noqa: E402
from lightning_megatron.parallel import ParallelLayout, ParallelState  # noqa: E402
from lightning_megatron.transformer import TransformerConfig  # noqa: E402

GiB, MiB = 2 ** 30, 2 ** 20
ROWS = [  # name, communicates, grad-buffer / optimizer options
    ("compute only (no DP reduction)", False, dict()),
    ("all-reduce after backward", True, dict()),
    ("all-reduce overlapped", True, dict(overlap_grad_reduce=True)),
    ("dist-opt, RS + AG after", True, dict(shard=True)),
    ("dist-opt, RS + AG overlapped", True, dict(shard=True, overlap_grad_reduce=True, overlap_param_gather=True)),
]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size per GPU")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--bucket-size", type=int, default=40_000_000, help="elements per bucket when overlapping")
    parser.add_argument("--precision", choices=["bf16-mixed", "bf16-true"], default="bf16-mixed",
                        help="bf16-mixed: fp32 parameters + bf16 autocast; bf16-true: bf16 parameters")
    parser.add_argument("--grad-reduce-in-fp32", action="store_true", help="with bf16-true: fp32 grad buffers")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="gloo + a tiny model: check the script, not the speed")
    args = parser.parse_args()
    if args.cpu:
        args.hidden, args.heads, args.layers, args.seq, args.vocab = 64, 4, 2, 32, 128
        args.bucket_size, args.warmup, args.steps, args.precision = 20_000, 1, 2, "fp32"
    return args


class Timer:
    """CUDA events on GPU, the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "Timer":
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def build(args, device: torch.device) -> GPTModel:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype)
    return GPTModel(config, args.vocab, max_sequence_length=args.seq).to(device)


def run_row(args, state: ParallelState, device: torch.device, communicates: bool, options: Dict) -> Dict:
    model = build(args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    shard = options.get("shard", False)
    overlap = options.get("overlap_grad_reduce", False)
    grads = DataParallelGrads(params, dense_group=state.dp_cp_group if communicates else None,
                              expert_group=state.edp_group if communicates else None,
                              divisor=state.size("dp-cp") if communicates else 1,
                              overlap_grad_reduce=overlap, bucket_size=args.bucket_size if overlap else None,
                              grad_reduce_in_fp32=args.grad_reduce_in_fp32, shard=shard)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    dist_opt = DistributedOptimizer([optimizer], grads, [model], options.get("overlap_param_gather", False)) \
        if shard else None
    gen = torch.Generator(device="cpu").manual_seed(1 + state.dp_rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" \
        else contextlib.nullcontext()
    times: List[float] = []
    loss = torch.zeros(())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        with Timer(device) as timer:
            grads.zero_grad()
            with autocast:
                loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
            loss.backward()
            loss = loss.detach()
            finalize_model_grads([model], state, grads=grads) if communicates else grads.finish_grad_sync()
            (dist_opt.attach_grads if dist_opt else grads.attach)()
            optimizer.step()
            if dist_opt is not None:
                dist_opt.gather_params()   # overlapped: waited for by the next forward's pre-hooks
            (dist_opt.detach_grads if dist_opt else grads.detach)()
        if i >= args.warmup:
            times.append(timer.seconds)
    if dist_opt is not None:
        dist_opt.finish_param_sync()
    state_bytes = dist_opt.optimizer_state_bytes() if dist_opt else sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    result = {"step_ms": 1e3 * statistics.median(times), "loss": loss.item(), "state_mib": state_bytes / MiB,
              "peak_gib": torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else float("nan"),
              "buckets": sum(len(b.buckets) for b in grads.buffers),
              "grad_gib": sum(b.data.numel() * b.data.element_size() for b in grads.buffers) / GiB,
              "grad_numel": sum(b.data.numel() for b in grads.buffers), "grad_dtype": grads.buffers[0].dtype,
              "params": sum(p.numel() for p in params)}
    if dist_opt is not None:
        dist_opt.close()
    grads.close()
    del model, optimizer, dist_opt, grads, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def bare_all_reduce_ms(args, state: ParallelState, device: torch.device, numel: int, dtype: torch.dtype) -> float:
    """One all-reduce of the whole gradient buffer alone: the communication to hide."""
    flat = torch.zeros(numel, dtype=dtype, device=device)
    times = []
    for i in range(args.warmup + args.steps):
        with Timer(device) as timer:
            dist.all_reduce(flat, group=state.dp_cp_group)
        if i >= args.warmup:
            times.append(timer.seconds)
    del flat
    return 1e3 * statistics.median(times)


def main() -> None:
    args = parse()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = ParallelState(ParallelLayout(world)).activate()
    results = []
    for name, communicates, options in ROWS:
        results.append((name, run_row(args, state, device, communicates, options)))
        dist.barrier()
    first = results[0][1]
    grad_dtype = first["grad_dtype"]
    bare = bare_all_reduce_ms(args, state, device, first["grad_numel"], grad_dtype)
    if rank == 0:
        print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} x{world}, "
              f"torch {torch.__version__}, {dist.get_backend()}")
        print(f"GPT: {first['params'] / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}, "
              f"seq {args.seq}, micro-batch {args.batch}/GPU, {args.precision}, gradient buffer "
              f"{first['grad_gib']:.2f} GiB ({grad_dtype}); overlap bucket size {args.bucket_size:,} elements")
        print(f"bare all-reduce of the gradient buffer: {bare:.2f} ms\n")
        header = f"{'configuration':34} {'step ms':>8} {'vs after':>8} {'exposed comm ms':>15} {'buckets':>7} " \
                 f"{'opt state MiB':>13} {'peak GiB':>8} {'loss':>8}"
        print(header)
        print("-" * len(header))
        base = results[1][1]["step_ms"]
        for name, r in results:
            print(f"{name:34} {r['step_ms']:8.2f} {base / r['step_ms']:7.3f}x {r['step_ms'] - first['step_ms']:15.2f} "
                  f"{r['buckets']:7d} {r['state_mib']:13.1f} {r['peak_gib']:8.2f} {r['loss']:8.4f}")
    state.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
