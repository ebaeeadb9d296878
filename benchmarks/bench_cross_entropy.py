"""Fused, chunked cross-entropy vs logits-then-loss: peak memory and step time of a GPT training step.

One GPU, ``GPTModel`` as users build it (bf16 parameters, no dropout, tied embeddings), one forward
and backward through the whole model per step (no optimizer: it does not depend on the loss path).
For each vocabulary the model is built once and ``cross_entropy_chunk_size`` switched between runs:
``None`` (the ``[s, b, V]`` logits whole, then ``vocab_parallel_cross_entropy``) and each ``--chunks``
size (with the Triton passes where Triton is installed; ``--torch-passes`` adds the pure-torch passes
at the first chunk size). The step's memory peak sits at the end of the forward / start of the backward, where all the
activations and the loss's own buffers are alive, so the loss path's saving is the peak's saving;
it does not depend on depth, hence ``--layers`` may shrink the model to fit a short run.

    python benchmarks/bench_cross_entropy.py                     # GPT-1.3B shape, mb 8, V=50304 and 128256
    python benchmarks/bench_cross_entropy.py --layers 4 --chunks 2048 8192
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def build(args, vocab: int):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh",
                               params_dtype=torch.bfloat16)
    return GPTModel(config, vocab, max_sequence_length=args.seq).cuda()


def run(model, batches, chunk, steps: int, warmup: int, kernels: bool = True):
    """(median step seconds, peak GiB over the timed steps, first loss) with ``cross_entropy_chunk_size=chunk``."""
    from lightning_megatron.tensor_parallel.fused_cross_entropy import kernels_enabled

    model.cross_entropy_chunk_size = chunk
    with kernels_enabled(kernels):
        return _timed(model, batches, steps, warmup)


def _timed(model, batches, steps: int, warmup: int):
    times, first = [], None
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ids, labels = batches[step % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(ids, labels=labels).mean()
        loss.backward()
        end.record()
        end.synchronize()
        first = loss.item() if first is None else first
        model.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[50304, 128256])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-passes", action="store_true", help="also the fused path without Triton")
    args = parser.parse_args()

    from lightning_megatron.parallel import ParallelLayout, ParallelState

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    ParallelState(ParallelLayout(1)).activate()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  layers {args.layers}, hidden "
          f"{args.hidden}, heads {args.heads}, seq {args.seq}, micro-batch {args.batch} "
          f"({args.batch * args.seq} tokens), bf16, fwd+bwd")

    rows = []
    for vocab in args.vocabs:
        t0 = time.time()
        model = build(args, vocab)
        built = time.time() - t0
        gen = torch.Generator(device="cuda").manual_seed(0)
        batches = [tuple(torch.randint(0, vocab, (args.batch, args.seq), device="cuda", generator=gen)
                         for _ in range(2)) for _ in range(2)]
        modes = [("unfused", None, True)] + [(f"fused, chunk {c}", c, True) for c in args.chunks]
        if args.torch_passes:
            modes.append((f"fused {args.chunks[0]}, torch", args.chunks[0], False))
        for name, chunk, kernels in modes:
            try:
                step, peak, loss = run(model, batches, chunk, args.steps, args.warmup, kernels)
            except Exception as err:   # out of memory (the unfused path at large vocabularies), or a kernel's error
                print(f"  V={vocab} {name}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                step, peak, loss = float("nan"), float("nan"), float("nan")
                model.zero_grad(set_to_none=True)
            rows.append((vocab, name, chunk, step, peak, loss, built))
            print(f"  V={vocab} {name}: {step * 1e3:.1f} ms, peak {peak:.2f} GiB, loss {loss:.4f}", flush=True)
            torch.cuda.empty_cache()
        del model, batches
        torch.cuda.empty_cache()

    from lightning_megatron.tensor_parallel.fused_cross_entropy import triton

    print(f"\nTriton passes: {'yes' if triton is not None else 'no (Triton not installed)'}")
    print(f"{'vocab':>7} {'loss path':<22} {'step ms':>8} {'peak GiB':>9} {'Δpeak GiB':>10} {'Δstep':>7} "
          f"{'loss0':>8} {'build s':>8}")
    base = {}
    for vocab, name, chunk, step, peak, loss, built in rows:
        if chunk is None:
            base[vocab] = (step, peak)
        ref_step, ref_peak = base[vocab]
        print(f"{vocab:>7} {name:<22} {step * 1e3:8.1f} {peak:9.2f} {peak - ref_peak:10.2f} "
              f"{step / ref_step - 1:+7.1%} {loss:8.4f} {built:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
