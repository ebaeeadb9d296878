"""Long-sequence GPT forward+backward on 2 GPUs: fits with context parallelism (CP=2), not without.

One sequence of ``--seq`` tokens (default 32768), bf16 parameters, no dropout, no recomputation,
loss = mean over all tokens (``context_parallel_loss_mean``). Three phases, all in one launch:

1. ``--layers auto`` (default): measure the peak memory of a 1- and a 2-layer model at CP=1 and at
   CP=2 on the full sequence (peak memory is linear in the layer count), then take the fewest
   layers whose CP=1 run needs ``--overcommit`` (1.2) times the GPU's memory; the CP=2 estimate is
   printed and must stay below 90% of it.
2. CP=2 (the sequence split over both GPUs): median step time of ``--steps`` forward+backward steps
   after ``--warmup``, tokens/s (the sequence's tokens per step time), TFLOP/s per GPU, and the peak
   memory of each GPU.
3. CP=1 (each GPU alone with the whole sequence, the layout ``dp=2``): the same step, expected to
   run out of memory; reported as OOM with the allocator's numbers, or timed if it fits.

    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py [--seq 32768 --hidden 2048 --heads 16]
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # before CUDA starts

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from typing import Dict, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_megatron.context_parallel import context_parallel_loss_mean, split_for_context_parallel  # noqa: E402
from lightning_megatron.models import GPTModel  # noqa: E402
from lightning_megatron.parallel import ParallelLayout, ParallelState  # noqa: E402
from lightning_megatron.transformer import TransformerConfig  # noqa: E402

GiB = 2 ** 30
# flash / memory-efficient kernels only: a silent fallback to the math kernel would materialise s² scores
FUSED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def build(args, cp: int, layers: int):
    state = ParallelState(ParallelLayout(dist.get_world_size(), cp=cp)).activate()
    config = TransformerConfig(num_layers=layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh",
                               params_dtype=torch.bfloat16)
    model = GPTModel(config, args.vocab, max_sequence_length=args.seq).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen),
             "labels": torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)}
    return state, model, split_for_context_parallel(batch, cp, state.cp_rank)


def step(model, local) -> torch.Tensor:
    with sdpa_kernel(FUSED_ATTENTION):
        loss = context_parallel_loss_mean(model(local["input_ids"], labels=local["labels"]))
        loss.backward()
    for param in model.parameters():
        param.grad = None
    return loss.detach()


def release(state: Optional[ParallelState]) -> None:
    if state is not None:
        state.destroy()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peak_of_one_step(args, cp: int, layers: int) -> float:
    """Peak GiB of one forward+backward (after a warm-up step)."""
    state, model, local = build(args, cp, layers)
    step(model, local)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(model, local)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GiB
    del model, local
    release(state)
    return peak


def choose_layers(args, capacity: float) -> int:
    fit: Dict[int, tuple] = {}
    for cp in (1, 2):
        one, two = peak_of_one_step(args, cp, 1), peak_of_one_step(args, cp, 2)
        fit[cp] = (one - (two - one), two - one)              # (intercept, GiB per layer)
    layers = max(2, math.ceil((args.overcommit * capacity - fit[1][0]) / fit[1][1]))
    estimate = {cp: base + layers * per_layer for cp, (base, per_layer) in fit.items()}
    if dist.get_rank() == 0:
        for cp, (base, per_layer) in fit.items():
            print(f"probe CP={cp}: {base:6.2f} GiB + {per_layer:5.3f} GiB/layer")
        print(f"chose {layers} layers: estimated peak {estimate[1]:.1f} GiB at CP=1, {estimate[2]:.1f} GiB at CP=2 "
              f"(GPU: {capacity:.1f} GiB)")
    if estimate[2] > 0.9 * capacity:
        raise SystemExit(f"at {layers} layers CP=2 would need ~{estimate[2]:.1f} GiB of {capacity:.1f}: use a "
                         f"smaller --hidden (memory per layer ~ seq·hidden, parameters ~ hidden²) or a longer --seq.")
    return layers


def timed(args, cp: int, layers: int) -> dict:
    state, model, local = build(args, cp, layers)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(model, local)
        end.record()
        end.synchronize()
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(start.elapsed_time(end) / 1e3)
    result = {"step_s": statistics.median(times), "peak_gib": torch.cuda.max_memory_allocated() / GiB,
              "reserved_gib": torch.cuda.max_memory_reserved() / GiB, "loss": losses[-1]}
    del model, local
    release(state)
    return result


def attempt(args, cp: int, layers: int) -> dict:
    """``timed``, or the out-of-memory report; the exception (and the tensors its frames hold) is dropped
    before the memory is released, so the process stays usable."""
    report = None
    try:
        return timed(args, cp, layers)
    except torch.OutOfMemoryError as err:
        report = {"oom": str(err).split("\n")[0][:300], "peak_gib": torch.cuda.max_memory_allocated() / GiB}
    release(None)
    return report


def flops_per_token(args, layers: int) -> float:
    """Forward+backward: 6 per parameter (N = 12·L·h² + V·h) plus causal attention, 6·L·s·h."""
    params = 12 * layers * args.hidden ** 2 + args.vocab * args.hidden
    return 6 * params + 6 * layers * args.seq * args.hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--layers", default="auto", help="a number, or 'auto' (see the module docstring)")
    parser.add_argument("--overcommit", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-cp1", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("nccl")
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc_per_node=2 (CP=2 over two GPUs).")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{torch.cuda.get_device_name()} ({capacity:.1f} GiB), torch {torch.__version__}; "
              f"GPT hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
              f"{args.batch} x {args.seq} tokens, bf16, forward+backward")

    layers = choose_layers(args, capacity) if args.layers == "auto" else int(args.layers)
    tokens = args.batch * args.seq
    rows = []
    for cp in ((2,) if args.skip_cp1 else (2, 1)):
        result = attempt(args, cp, layers)
        every = [None, None]
        dist.all_gather_object(every, result)
        rows.append((cp, every))
    if not rank0:
        dist.destroy_process_group()
        return
    print(f"\n{layers} layers, {12 * layers * args.hidden ** 2 / 1e9:.2f}B transformer parameters, "
          f"{flops_per_token(args, layers) / 1e9:.1f} GFLOP/token\n")
    print("layout                       step s  tokens/s (2 GPUs)  per GPU  TFLOP/s/GPU  peak GiB GPU0, GPU1  loss")
    for cp, every in rows:
        name = "CP=2 (sequence over 2 GPUs)" if cp == 2 else "CP=1 (one GPU per sequence)"
        if any("oom" in r for r in every):
            print(f"{name:27s}  out of memory (peak {every[0]['peak_gib']:.1f} / {every[1]['peak_gib']:.1f} GiB "
                  f"when it failed): {next(r['oom'] for r in every if 'oom' in r)}")
            continue
        r = every[0]
        pair = tokens / r["step_s"] * (1 if cp == 2 else 2)       # CP=1: each GPU runs its own sequence
        tflops = pair / 2 * flops_per_token(args, layers) / 1e12
        print(f"{name:27s}  {r['step_s']:6.3f}  {pair:17.0f}  {pair / 2:7.0f}  {tflops:11.1f}  "
              f"{every[0]['peak_gib']:8.1f}, {every[1]['peak_gib']:8.1f}  {r['loss']:.3f}")
    print(f"(max reserved: {max(r.get('reserved_gib', 0.0) for _, every in rows for r in every):.1f} GiB)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
