"""What the shard checksums cost: ``save_sharded``/``load_sharded`` of a GPT and its AdamW state, with and without.

One process (gloo world of 1), CPU. Each round saves and loads once with checksums and once without, alternating
which goes first; the medians over the rounds are printed, and the share of save+load time the checksums add.

    PYTHONPATH=. python benchmarks/bench_checkpoint_checksums.py [--hidden 768 --layers 6 --vocab 32000 --rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from lightning_megatron.checkpoint import load_sharded, save_sharded
from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.transformer import TransformerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
    ParallelState(ParallelLayout(1)).activate()
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64)
    model = GPTModel(config, args.vocab, 128)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()   # creates the moments
    root = tempfile.mkdtemp(dir=args.dir)
    times = {(on, what): [] for on in (True, False) for what in ("save", "load")}
    for round_ in range(args.rounds):
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            path = os.path.join(root, f"ckpt-{on}")
            start = time.perf_counter()
            save_sharded(path, model, optimizer, checksums=on)
            times[(on, "save")].append(time.perf_counter() - start)
            start = time.perf_counter()
            load_sharded(path, model, optimizer)
            times[(on, "load")].append(time.perf_counter() - start)
    size = sum(os.path.getsize(os.path.join(root, "ckpt-True", f)) for f in os.listdir(os.path.join(root, "ckpt-True")))
    shutil.rmtree(root)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint {size / 2**20:.0f} MiB (model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params "
          f"+ AdamW moments), {args.rounds} rounds, torch {torch.__version__}, {os.cpu_count()} CPUs")
    for on in (False, True):
        print(f"checksums={on!s:5}  save {med[(on, 'save')]:.3f} s  load {med[(on, 'load')]:.3f} s  "
              f"total {med[(on, 'save')] + med[(on, 'load')]:.3f} s")
    base = med[(False, "save")] + med[(False, "load")]
    extra = med[(True, "save")] + med[(True, "load")] - base
    print(f"checksums add {100 * extra / base:+.1f}% of save+load "
          f"(save {100 * (med[(True, 'save')] / med[(False, 'save')] - 1):+.1f}%, "
          f"load {100 * (med[(True, 'load')] / med[(False, 'load')] - 1):+.1f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
