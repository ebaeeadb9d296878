"""Single-GPU GPT training throughput: lightning_megatron's GPTModel vs a minimal PyTorch GPT.

Same shape for both (default: the ~1.3B GPT of the models issue: 24 layers, hidden 2048,
16 heads, vocab 50304, sequence 2048, micro-batch 4, bf16 parameters, fused AdamW, no dropout).
FLOPs per token = 6·N + 12·L·S·H with N = 12·L·H² + V·H. MFU is reported against the
chip's bf16 peak measured in the same run (an 8192³ matmul) and against 790 TFLOP/s.

    python benchmarks/bench_gpt.py [--layers 24 --hidden 2048 --heads 16 --seq 2048 --batch 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

NOMINAL_PEAK = 790e12


# -- the alternative a user would pick: a minimal single-file GPT --------------------------------------


class MinimalBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class MinimalGPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(MinimalBlock(h, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


# -- ours ----------------------------------------------------------------------------------------------


def build_ours(args):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh",
                               params_dtype=torch.bfloat16)
    model = GPTModel(config, args.vocab, max_sequence_length=args.seq).cuda()

    def loss_fn(ids, labels):
        return model(ids, labels=labels).mean()
    return model, loss_fn


def build_minimal(args):
    model = MinimalGPT(args.layers, args.hidden, args.heads, args.vocab, args.seq).to("cuda", torch.bfloat16)
    return model, model


def time_training(model, loss_fn, args, steps: int, warmup: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)) for _ in range(4)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(warmup + steps):
        ids, labels = batches[step % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        losses.append(loss.item())
        if step >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, losses


def measured_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    runs = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    from lightning_megatron.parallel import ParallelLayout, ParallelState

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    ParallelState(ParallelLayout(1)).activate()

    L, H, V, S = args.layers, args.hidden, args.vocab, args.seq
    n_params = 12 * L * H * H + V * H
    flops_per_token = 6 * n_params + 12 * L * S * H
    tokens = args.batch * S
    peak = measured_peak()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s;  N = {n_params / 1e9:.3f}B, "
          f"{flops_per_token / 1e9:.2f} GFLOP/token, {tokens} tokens/step")

    rows = []
    for name, build in (("minimal PyTorch GPT", build_minimal), ("lightning_megatron GPTModel", build_ours),
                        ("minimal PyTorch GPT (again)", build_minimal)):
        t0 = time.time()
        model, loss_fn = build(args)
        built = time.time() - t0
        step, mem, losses = time_training(model, loss_fn, args, args.steps, args.warmup)
        achieved = flops_per_token * tokens / step
        rows.append((name, step, tokens / step, achieved / peak, achieved / NOMINAL_PEAK, mem, built, losses[0]))
        del model, loss_fn
        torch.cuda.empty_cache()

    print(f"\n{'model':<30} {'step ms':>8} {'tokens/s':>10} {'MFU(meas)':>10} {'MFU(790)':>9} "
          f"{'peak GiB':>9} {'build s':>8} {'loss0':>7}")
    for name, step, tps, mfu, mfu_nominal, mem, built, loss0 in rows:
        print(f"{name:<30} {step * 1e3:8.1f} {tps:10.0f} {mfu:10.1%} {mfu_nominal:9.1%} {mem:9.1f} "
              f"{built:8.1f} {loss0:7.3f}")
    ours, minimal = rows[1][1], min(rows[0][1], rows[2][1])
    print(f"\nours / minimal throughput: {minimal / ours:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
