"""Ours against what a Llama user would pick instead, through Lightning, side by side (issue #32).

- ``ours`` / ``ours-compiled``: ``LlamaModel`` through ``Trainer(strategy=MegatronStrategy(...))`` with
  ``compile_layers=False`` / ``True``; ``ours-overlap`` / ``ours-compiled-overlap`` with ``tp_comm_overlap=True``
  too (``--tp`` >= 2); ``ours-fp8`` / ``ours-compiled-fp8`` with ``fp8="tensorwise"`` (torchao's float8 linears;
  emulated on the CPU), ``ours-compiled-fp8-out`` with the output layer in float8 too
  (``Float8Config(output_layer=True)``), ``ours-compiled-fp8-recast`` with each weight recast in every call
  (``Float8Config(cache_weights=False)``; the default casts once per step); ``ours-compiled-nogaf`` with
  ``gradient_accumulation_fusion=False`` (the default, ``"auto"``, fuses in compiled layers; ``ours-compiled-gaf``,
  ``True``, is the same there); a ``-graphs`` word anywhere in the name (``ours-compiled-fp8-graphs``) adds per-block
  CUDA graphs (``cuda_graph="partial", cuda_graph_scope="block"``; the eager capture backend on the CPU); an
  ``-unsplit`` word calls float8 column-parallel linears whole under graphs too (their input gradient's collective
  not overlapped with the weight gradient; they split only in graphs), ``-qkvapart`` runs grouped-query
  attention's q and kv as two linears on one gathered input (not overlapped: the path before the overlap), each
  for an A/B in one call;
- ``peer`` / ``peer-compiled``: a torchtitan-style plain Llama written here (``PeerLlama``: nn.Linear
  projections, ``nn.RMSNorm``, complex-number RoPE from precomputed ``freqs_cis``, SDPA with GQA, SwiGLU, the
  loss on float32 logits), eager or with each block ``torch.compile``d as torchtitan does, through
  ``Trainer(strategy="auto")`` on one GPU; with ``--gpus N``: ``ModelParallelStrategy`` with torchtitan's
  tensor-parallel plan (``peer-tp``), FSDP2 ``fully_shard`` per block (``peer-fsdp``) or Lightning ``"ddp"``
  (plain ``peer``/``peer-compiled`` above one GPU: DDP whatever ``--tp`` says). The table's ratios divide the
  compiled peer of the same layout: ``peer-tp-compiled`` at ``--tp`` > 1, else ``peer-compiled``.
  Ours above one data-parallel rank: the distributed optimizer with overlapped reduce-scatter and gather.

Same shape, tokens per optimizer step (``--batch`` sequences, micro-batches of ``--micro-batch``: ours splits
the batch, the peers accumulate), bf16-true, fused AdamW, no clipping. Each configuration runs in its own
process(es) (``torchrun`` above one GPU). Step time: wall time over the timed steps between two
``cuda.synchronize`` (the first steps compile and are not timed). MFU: model FLOPs
(``transformer/flops.py``) per second over ``--peak`` (measured bf16 dense peak of H100/H200, ~790 TFLOP/s).

    python benchmarks/bench_peers.py --shape 1b                                  # 1 GPU: four configurations
    python benchmarks/bench_peers.py --shape 8b-layers --configs ours-compiled,peer-compiled
    torchrun --nproc-per-node 2 benchmarks/bench_peers.py --only ours-compiled --tp 2 --shape 8b-layers
    python benchmarks/bench_peers.py --tiny --accelerator cpu --configs ours,peer   # plumbing on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from isolated import print_result, run_isolated   # benchmarks/isolated.py
from timing import idle_gaps   # benchmarks/timing.py

SHAPES = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 heads, 8 kv heads, SwiGLU 8192, vocabulary 128256, untied head
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=4096),
    # Llama-3-8B's layer shape, 8 layers
    "8b-layers": dict(layers=8, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=4096),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32),
}
CONFIGS = ("ours", "ours-compiled", "peer", "peer-compiled")


# -- the peer: a plain Llama as torchtitan writes it ---------------------------------------------------------
def precompute_freqs_cis(head_dim: int, seq: int, theta: float = 500000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk))


class PeerAttention(nn.Module):
    def __init__(self, s: dict) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = s["heads"], s["kv_heads"], s["hidden"] // s["heads"]
        self.wq = nn.Linear(s["hidden"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s["hidden"], self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(s["hidden"], self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, s["hidden"], bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)   # -1: this rank's heads under tensor parallelism
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class PeerFeedForward(nn.Module):
    def __init__(self, s: dict) -> None:
        super().__init__()
        self.w1 = nn.Linear(s["hidden"], s["ffn"], bias=False)
        self.w2 = nn.Linear(s["ffn"], s["hidden"], bias=False)
        self.w3 = nn.Linear(s["hidden"], s["ffn"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PeerBlock(nn.Module):
    def __init__(self, s: dict) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(s["hidden"], eps=1e-5)
        self.attention = PeerAttention(s)
        self.ffn_norm = nn.RMSNorm(s["hidden"], eps=1e-5)
        self.feed_forward = PeerFeedForward(s)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class PeerLlama(nn.Module):
    def __init__(self, s: dict) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s["vocab"], s["hidden"])
        self.layers = nn.ModuleDict({str(i): PeerBlock(s) for i in range(s["layers"])})
        self.norm = nn.RMSNorm(s["hidden"], eps=1e-5)
        self.output = nn.Linear(s["hidden"], s["vocab"], bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(s["hidden"] // s["heads"], s["seq"]),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis[:tokens.shape[1]])
        return self.output(self.norm(h))


# -- one configuration in this process (or these torchrun processes) ---------------------------------------
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, s: dict) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, s["vocab"], (n, s["seq"] + 1), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def run_one(name: str, args: argparse.Namespace) -> dict:
    import lightning as L

    s = SHAPES[args.shape]
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    ours = name.startswith("ours")
    compiled = "compiled" in name
    dp = gpus // args.tp if (ours or name.startswith("peer-tp")) else gpus
    per_rank = args.batch // dp                 # sequences per rank per optimizer step
    accumulate = 1 if ours else per_rank // args.micro_batch
    marks: dict = {}
    cuda = args.accelerator == "gpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Module(L.LightningModule):
        def configure_model(self) -> None:
            if hasattr(self, "model"):
                return
            if ours:
                from lightning_megatron.models import LlamaModel, llama_config

                cfg = llama_config(s["layers"], s["hidden"], s["heads"], num_query_groups=s["kv_heads"],
                                   ffn_hidden_size=s["ffn"], rotary_base=500000.0,
                                   gradient_accumulation_fusion=(
                                       False if name.endswith("-nogaf") else True if name.endswith("-gaf") else "auto"))
                self.model = LlamaModel(cfg, s["vocab"], s["seq"])
                return
            self.model = PeerLlama(s)
            if name in ("peer-tp", "peer-tp-compiled"):
                apply_peer_tp(self.model, self.device_mesh)
            if name in ("peer-fsdp", "peer-fsdp-compiled"):
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                for block in self.model.layers.values():
                    fully_shard(block, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
                fully_shard(self.model, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
            if compiled:
                for key, block in self.model.layers.items():
                    self.model.layers[key] = torch.compile(block, fullgraph=True)

        def training_step(self, batch, batch_idx):
            if ours:
                return self.model(batch["input_ids"], labels=batch["labels"]).float().mean()
            logits = self.model(batch["input_ids"])
            if name.startswith("peer-tp"):
                from torch.distributed.tensor.parallel import loss_parallel

                with loss_parallel():
                    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

        def backward(self, loss, *args, **kwargs):
            if not name.startswith("peer-tp"):
                return super().backward(loss, *args, **kwargs)
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():   # the backward of the vocabulary-sharded loss too, as torchtitan does
                loss.backward(*args, **kwargs)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            step = batch_idx // accumulate
            if batch_idx % accumulate == 0 and step in (0, args.warmup):
                sync()
                marks[step] = time.perf_counter()
            if args.profile and batch_idx % accumulate == 0 and step == args.warmup + args.steps:
                activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
                marks["profiler"] = torch.profiler.profile(activities=[activity])
                marks["profiler"].__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            step = batch_idx // accumulate
            if (batch_idx + 1) % accumulate == 0 and step == args.warmup + args.steps - 1:
                sync()
                marks["end"] = time.perf_counter()

        def on_train_end(self, trainer, module):
            sync()
            if "profiler" in marks:
                marks["profiler"].__exit__(None, None, None)

    if ours:
        from lightning_megatron import MegatronStrategy

        fp8, words = None, set(name.split("-"))
        if "fp8" in words:
            from lightning_megatron.quantization.float8 import Float8Config

            fp8 = Float8Config("tensorwise", emulate=not cuda, output_layer="out" in words,
                               cache_weights=False if "recast" in words else None)
        if "unsplit" in words:   # A/B: float8 column-parallel linears called whole, their backward not overlapped
            from lightning_megatron.quantization.float8 import Float8Matmul

            Float8Matmul.split_gemms = lambda self, *args: None   # (this configuration's own processes only)
        if "qkvapart" in words:   # A/B: queries and keys/values as two linears on one gathered input, not overlapped
            from lightning_megatron.transformer.attention import SelfAttention

            SelfAttention._one_column_linear = lambda self: False   # (this configuration's own processes only)
        graphs = dict(cuda_graph="partial", cuda_graph_scope="block",
                      cuda_graph_backend="cuda" if cuda else "eager") if "graphs" in words else {}
        strategy = MegatronStrategy(tensor_model_parallel_size=args.tp, sequence_parallel=args.tp > 1,
                                    tp_comm_overlap="overlap" in words, fp8=fp8,
                                    micro_batch_size=args.micro_batch, compile_layers=compiled,
                                    use_distributed_optimizer=dp > 1, overlap_grad_reduce=dp > 1,
                                    overlap_param_gather=dp > 1, **graphs)
        batch = per_rank
    else:
        batch = args.micro_batch
        if name.startswith("peer-tp") or name.startswith("peer-fsdp"):
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp if "tp" in name else 1)
        else:
            strategy = "ddp" if gpus > 1 else "auto"
    steps = args.warmup + args.steps + args.profile   # the profiled steps come after the timed ones
    trainer = L.Trainer(accelerator=args.accelerator, devices=gpus, strategy=strategy, precision="bf16-true",
                        max_steps=steps, accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()])
    data = Tokens(args.batch * steps, s)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=batch, drop_last=True))
    step_s = (marks["end"] - marks[args.warmup]) / args.steps
    kernels = kernel_summary(marks["profiler"], args.profile, args.profile_top) if "profiler" in marks else None
    from lightning_megatron.models import llama_config
    from lightning_megatron.transformer.flops import training_flops_per_sequence

    cfg = llama_config(s["layers"], s["hidden"], s["heads"], num_query_groups=s["kv_heads"], ffn_hidden_size=s["ffn"])
    flops = training_flops_per_sequence(cfg, s["seq"], s["vocab"]) * args.batch
    return {"step_ms": step_s * 1e3, "first_steps_s": marks[args.warmup] - marks[0],
            "mfu": flops / step_s / gpus / args.peak,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, "kernels": kernels}


KINDS = (   # kernel name fragments -> what they are (first match wins)
    ("nccl", "communication"), ("flash", "attention"), ("fmha", "attention"), ("cudnn", "attention"),
    ("attention", "attention"), ("gemm", "matmul"), ("nvjet", "matmul"), ("sm90_xmma", "matmul"),
    ("cutlass", "matmul"), ("triton", "triton (fused)"), ("cross_entropy", "loss"), ("softmax", "loss"),
    ("nll", "loss"), ("multi_tensor", "optimizer"), ("adam", "optimizer"),
)


def kernel_summary(prof, steps: int, top_n: int = 15) -> dict:
    """GPU kernel time per step by kind, and the 15 longest kernels (ms per step)."""
    kinds: dict = {}
    names: dict = {}
    other: dict = {}
    for event in prof.key_averages():
        ms = event.device_time_total / 1e3 / steps if hasattr(event, "device_time_total") else \
            event.cuda_time_total / 1e3 / steps
        if ms <= 0 or event.key.startswith("ProfilerStep"):
            continue
        low = event.key.lower()
        if low.startswith("aten::") or low.startswith("cuda") and "kernel" not in low:
            continue
        kind = next((k for frag, k in KINDS if frag in low), "other elementwise/copies")
        kinds[kind] = kinds.get(kind, 0.0) + ms
        names[event.key[:90]] = names.get(event.key[:90], 0.0) + ms
        if kind == "other elementwise/copies":
            other[event.key[:90]] = other.get(event.key[:90], 0.0) + ms
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:top_n])
    top_other = dict(sorted(other.items(), key=lambda kv: -kv[1])[:10])
    return {"by_kind_ms": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "total_ms": round(sum(kinds.values()), 2), "top_ms": {k: round(v, 2) for k, v in top.items()},
            "top_other_ms": {k: round(v, 2) for k, v in top_other.items()},
            **idle_gaps(prof, steps)}


def apply_peer_tp(model: PeerLlama, mesh) -> None:
    """torchtitan's plan: wq/wk/wv/w1/w3 colwise, wo/w2 rowwise, sequence-parallel norms, loss_parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = mesh["tensor_parallel"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


PEERS = ("peer", "peer-compiled", "peer-tp", "peer-tp-compiled", "peer-fsdp", "peer-fsdp-compiled")
OURS_WORDS = ("compiled", "fp8", "out", "recast", "unsplit", "qkvapart", "graphs", "overlap", "gaf", "nogaf")


def check_config(name: str) -> None:
    """A configuration name this script knows, else one error naming the word it does not (a typo would otherwise
    measure another configuration than the one named)."""
    if name in PEERS:
        return
    first, *words = name.split("-")
    unknown = [w for w in words if w not in OURS_WORDS]
    if first == "ours" and not unknown:
        return
    why = f"unknown words: {', '.join(unknown)}" if first == "ours" else "neither ours-... nor a peer"
    raise SystemExit(f"--configs: unknown configuration {name!r} ({why}); use ours-<words> with words among "
                     f"{', '.join(OURS_WORDS)}, or one of {', '.join(PEERS)}")


def baseline_name(tp: int) -> str:
    """The compiled peer of the same layout, which the table's ratios divide: DTensor TP (``peer-tp-compiled``) at
    ``--tp`` > 1, else ``peer-compiled`` (one GPU, or Lightning's DDP over ``--gpus``)."""
    return "peer-tp-compiled" if tp > 1 else "peer-compiled"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--only", help="one configuration, in this process (under torchrun: these processes)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ours and peer-tp)")
    parser.add_argument("--gpus", type=int, default=1, help="processes per configuration (torchrun above 1)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (global)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak", type=float, default=790e12)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (plumbing)")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones")
    parser.add_argument("--profile-top", type=int, default=15, help="list this many of the longest kernels")
    args = parser.parse_args()
    if args.tiny:
        args.shape = "tiny"
    if args.only:
        result = run_one(args.only, args)
        if int(os.environ.get("RANK", "0")) == 0:
            print_result(result)
        return
    for name in args.configs.split(","):
        check_config(name)
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "CPU"
    print(f"device: {args.gpus}x {device}  torch {torch.__version__}  shape {args.shape} {SHAPES[args.shape]}  "
          f"batch {args.batch} (micro {args.micro_batch})  tp {args.tp}", flush=True)
    results = {}
    for name in args.configs.split(","):
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            print(f"{name}: SKIPPED (budget)", flush=True)
            continue
        base = [os.path.abspath(__file__), "--only", name, "--shape", args.shape, "--tp", str(args.tp),
                "--batch", str(args.batch), "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
                "--steps", str(args.steps), "--peak", str(args.peak), "--accelerator", args.accelerator,
                "--profile", str(args.profile), "--profile-top", str(args.profile_top)]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
               if args.gpus > 1 else [sys.executable]) + base
        r = run_isolated(name, cmd, left)
        if r is None:
            continue
        results[name] = r
        print(f"{name}: {r['step_ms']:.1f} ms/step  MFU {r['mfu']:.1%}  peak {r['peak_gib']:.1f} GiB  "
              f"first {args.warmup} steps {r['first_steps_s']:.0f} s", flush=True)
        if r["kernels"]:
            print(f"  kernels per step: {json.dumps(r['kernels'], indent=1)}", flush=True)
    base_name = baseline_name(args.tp)
    base = results.get(base_name)
    print(f"\n| configuration | step ms | MFU | peak GiB | speed vs {base_name} |\n|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{base['step_ms'] / r['step_ms']:.3f}x" if base else "-"
        print(f"| {name} | {r['step_ms']:.1f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | {ratio} |")
    print(f"\ntotal {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
