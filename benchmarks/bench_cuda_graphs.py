"""Step time of a launch-bound GPT on one GPU: eager vs per-layer ("partial") vs full-iteration CUDA graphs.

A small model (default: 6 layers, hidden 256, sequence 128, micro-batch 4, 4 micro-batches per
step, bf16, dropout 0.1) spends most of its step launching kernels, which is what graphs remove.
Each mode trains a fresh copy of the same model on the same batches; the table reports the median
time of a whole step (forward-backward of every micro-batch + fused AdamW, which stays eager in
every mode) and of the forward-backward alone, after ``--warmup`` untimed steps (graph capture
included there), and the first/last loss to show the modes train identically.

    python benchmarks/bench_cuda_graphs.py [--layers 6 --hidden 256 --seq 128 --batch 4 --micro 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def run_mode(mode: str, args: argparse.Namespace):
    from lightning_megatron.cuda_graphs import FullCudaGraphWrapper, PartialCudaGraphs, layer_chunks
    from lightning_megatron.models import GPTModel
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel import get_rng_tracker
    from lightning_megatron.pipeline import forward_backward
    from lightning_megatron.pipeline.schedules import schedule_order
    from lightning_megatron.tensor_parallel import model_parallel_seed
    from lightning_megatron.transformer import TransformerConfig

    state = ParallelState(ParallelLayout(1)).activate()
    model_parallel_seed(1234)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               hidden_dropout=args.dropout, attention_dropout=args.dropout,
                               activation="gelu_tanh", params_dtype=torch.bfloat16)
    model = GPTModel(config, args.vocab, max_sequence_length=args.seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = args.batch * args.micro
    batches = [(torch.randint(0, args.vocab, (total, args.seq), device="cuda", generator=gen),
                torch.randint(0, args.vocab, (total, args.seq), device="cuda", generator=gen)) for _ in range(4)]

    def fwd_bwd(ids, labels):
        micro = [(ids[i * args.batch:(i + 1) * args.batch], labels[i * args.batch:(i + 1) * args.batch])
                 for i in range(args.micro)]
        return forward_backward(lambda mb, chunk, ctx: chunk(mb[0], labels=mb[1]).mean(), micro, model).loss

    graphs = wrapper = None
    scope = mode.split(":")[1] if ":" in mode else "layer"
    if mode.startswith("partial"):
        graphs = PartialCudaGraphs(layer_chunks(model), scope=scope.split("+"), warmup_steps=args.graph_warmup,
                                   rng_tracker=get_rng_tracker(state))
    elif mode == "full":
        wrapper = FullCudaGraphWrapper(fwd_bwd, params=model.parameters(), warmup_steps=args.graph_warmup,
                                       rng_tracker=get_rng_tracker(state))
    order = schedule_order(args.micro, 1, 0)
    step_times, fb_times, losses = [], [], []
    capture_s = 0.0
    for step in range(args.warmup + args.steps):
        ids, labels = batches[step % len(batches)]
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        t0 = time.perf_counter()
        start.record()
        opt.zero_grad(set_to_none=True)
        if graphs is not None:
            graphs.begin_step(order)
        loss = wrapper(ids, labels) if wrapper is not None else fwd_bwd(ids, labels)
        mid.record()
        opt.step()
        end.record()
        end.synchronize()
        if step == args.graph_warmup:
            capture_s = time.perf_counter() - t0
        losses.append(float(loss))
        if step >= args.warmup:
            step_times.append(start.elapsed_time(end))
            fb_times.append(start.elapsed_time(mid))
    stats = graphs.stats() if graphs is not None else {}
    return statistics.median(step_times), statistics.median(fb_times), losses, capture_s, stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--graph-warmup", type=int, default=2)
    parser.add_argument("--modes", default="eager,partial,partial:attn+mlp,full,eager")
    args = parser.parse_args()

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.batch} x "
          f"{args.micro}, bf16, dropout {args.dropout}; median of {args.steps} steps after {args.warmup}")
    rows = []
    for mode in args.modes.split(","):
        try:
            rows.append((mode,) + run_mode(mode, args))
        except Exception as exc:   # keep measuring the other modes
            print(f"{mode}: FAILED {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    print(f"\n{'mode':<20} {'step ms':>8} {'fwd+bwd ms':>11} {'vs eager':>9} {'capture s':>10} "
          f"{'loss[0]':>8} {'loss[-1]':>9}  graphs")
    eager = min((r[1] for r in rows if r[0] == "eager"), default=None)
    for mode, step, fb, losses, capture, stats in rows:
        ratio = f"{eager / step:.2f}x" if eager else "-"
        print(f"{mode:<20} {step:8.2f} {fb:11.2f} {ratio:>9} {capture if mode != 'eager' else 0:10.2f} "
              f"{losses[0]:8.4f} {losses[-1]:9.4f}  {stats.get('graphs', '')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
