"""Compiled vs eager layers at tensor parallel 2, step by step (issue #32's open item: on two H200s the
compiled tp2+sp run's second-step loss differed from eager by 0.75%, while gloo on the CPU is exact).

Prints, per AdamW step, both losses and the largest gradient difference (and which parameter), for a tiny
Llama with the chosen sequence parallelism and dropout, so the cause (dropout RNG, sequence-parallel
collectives, the backward's traced collectives) can be narrowed by switching them:

    python benchmarks/check_compiled_tp.py --device cuda --sp 1 --dropout 0.1     # two GPUs, NCCL
    python benchmarks/check_compiled_tp.py --device cuda --sp 1 --dropout 0.0
    python benchmarks/check_compiled_tp.py --device cpu --sp 1 --dropout 0.1      # gloo reference (exact)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from lightning_megatron.testing import run_on_ranks


def train(compiled: bool, steps: int, sp: bool, dropout: float, device: str, backend: str):
    import torch._dynamo

    from lightning_megatron.models import LlamaModel, llama_config
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer.compile import compile_layers

    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=dist.get_world_size())).activate()
    torch._dynamo.reset()
    model_parallel_seed(3)
    cfg = llama_config(2, 32, 4, num_query_groups=2, ffn_hidden_size=64, sequence_parallel=sp,
                       hidden_dropout=dropout, attention_dropout=dropout)
    model = LlamaModel(cfg, 64, 16).to(device)
    if compiled:
        compile_layers(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=gen).to(device)
        loss = model(ids, labels=ids).float().mean()
        loss.backward()
        grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state.destroy()
    return losses, grads


def compare(steps: int, sp: bool, dropout: float, device: str, backend: str):
    eager = train(False, steps, sp, dropout, device, backend)
    compiled = train(True, steps, sp, dropout, device, backend)
    rows = []
    for step in range(steps):
        worst = max(((compiled[1][step][n] - g).abs().max().item(), n) for n, g in eager[1][step].items())
        rows.append((step, eager[0][step], compiled[0][step], worst))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2, help="ranks (all tensor parallel); 1 is the numerics control")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: tracing only)")
    args = parser.parse_args()
    rows = run_on_ranks(compare, args.tp, args.steps, bool(args.sp), args.dropout, args.device, args.backend,
                        backend="nccl" if args.device == "cuda" else "gloo", timeout=600)[0]
    print(f"tp{args.tp} sp={bool(args.sp)} dropout={args.dropout} {args.device} backend={args.backend}")
    for step, eager, compiled, (diff, name) in rows:
        print(f"step {step}: loss eager {eager:.7f} compiled {compiled:.7f}  max |grad diff| {diff:.2e} ({name})")


if __name__ == "__main__":
    main()
