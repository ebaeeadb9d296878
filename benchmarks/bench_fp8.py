"""FP8 training through torchao vs bfloat16, through the Trainer, on one GPU (issue #20).

GPT-1.3B (24 layers, hidden 2048, 16 heads, sequence 2048, micro-batch 4, vocabulary 50304, no dropout)
with ``Trainer(strategy=MegatronStrategy(), precision="bf16-true")``, fused AdamW (lr 3e-4 after a
20-step linear warm-up, betas 0.9/0.95), gradient clipping at 1.0, same seed and same batches for
every configuration:

- ``bf16``: the model as it is;
- ``fp8-tensorwise`` / ``fp8-rowwise``: ``enable_fp8(model, recipe)`` in ``configure_model`` (every
  column/row-parallel linear through torchao's float8 matmul, compiled: the default);
- ``fp8-tensorwise-out``: ``Float8Config(output_layer=True)``: the output layer's GEMMs (inside the fused loss)
  in float8 too;
- ``fp8-tensorwise-eager``: the same without ``torch.compile`` (fewer steps: speed only);
- ``...-layers``: ``Float8Config(compile_layers=True)``: each transformer layer compiled whole, so the
  casts fuse with the norms / activation / residual adds; ``bf16-compiled-layers``: the same
  compilation without float8 (the yardstick of what compilation alone gives);
  ``fp8-tensorwise-layers-pow2``: also ``round_scales_to_power_of_2=True``;
- ``fp8-rowwise-experts``: ``Float8Config("rowwise", grouped_experts=True)``: with ``--shape moe``, the MoE
  experts' grouped GEMMs in float8 too (the other fp8 configurations leave them in bf16, the default);
- ``bf16-seed1``: bf16 with another initialization seed and the same batches in the same order: the
  natural run-to-run spread of the loss curve, to judge the fp8-vs-bf16 differences against.

The data is learnable, so the loss curve means something: token sequences of a fixed random bigram
process over 4096 token ids (the next token is a fixed successor of the current one with probability
0.75, uniform otherwise; the loss floor is about 2.6 nats).

Each configuration runs in its own process. Step time: wall time from step 20 to the last step with
one ``cuda.synchronize`` at each end (the first steps compile). Loss: every step's training loss; the
curves are compared as means over windows of 10 steps (max relative difference to bf16).

    python benchmarks/bench_fp8.py                   # everything, then the table
    python benchmarks/bench_fp8.py --only fp8-rowwise
    python benchmarks/bench_fp8.py --tiny            # a 2-layer model on the CPU, torchao's emulation: plumbing
    python benchmarks/bench_fp8.py --shape h4096 --configs bf16,fp8-tensorwise-layers --steps 40
    python benchmarks/bench_fp8.py --shape moe --configs bf16,fp8-rowwise,fp8-rowwise-experts --steps 50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

GPT = dict(layers=24, hidden=2048, heads=16, seq=2048, batch=4, vocab=50304)
SHAPES = {   # --shape: the GPT-1.3B, or fewer, wider layers (how the float8 gain grows with the GEMMs)
    "1.3b": dict(GPT),
    "h4096": dict(layers=8, hidden=4096, heads=32, seq=2048, batch=4, vocab=50304),
    "h8192": dict(layers=2, hidden=8192, heads=64, seq=2048, batch=4, vocab=50304),
    # an MoE GPT: 16 experts top-2 on every layer (SwiGLU, 1408 per expert), dropless, balancing loss 1e-2
    "moe": dict(layers=12, hidden=2048, heads=16, seq=2048, batch=4, vocab=50304, experts=16, topk=2,
                expert_ffn=1408),
}
STEPS, TIMED_FROM, WINDOW = 200, 20, 10
LR, LR_WARMUP = 3e-4, 20
USED_TOKENS, FOLLOW = 4096, 0.75
CONFIGS = {   # name: what differs from bf16 (fp8 recipe, Float8Config fields, seed of the initialization, steps)
    "bf16": dict(),
    "bf16-seed1": dict(seed=1),   # another initialization, the same batches: the run-to-run spread of the loss
    "bf16-compiled-layers": dict(compile_layers=True),   # each TransformerLayer compiled, no float8
    "fp8-tensorwise": dict(fp8="tensorwise"),
    "fp8-tensorwise-out": dict(fp8="tensorwise", output_layer=True),   # the output layer in float8 too
    "fp8-tensorwise-layers": dict(fp8="tensorwise", compile_layers=True),
    "fp8-tensorwise-layers-pow2": dict(fp8="tensorwise", compile_layers=True, round_scales_to_power_of_2=True),
    "fp8-rowwise": dict(fp8="rowwise"),
    "fp8-rowwise-layers": dict(fp8="rowwise", compile_layers=True),
    "fp8-rowwise-experts": dict(fp8="rowwise", grouped_experts=True),   # MoE experts in float8 too
    "fp8-tensorwise-eager": dict(fp8="tensorwise", compile=False, steps=40),
}


class BigramBatches(torch.utils.data.Dataset):
    """``n`` sequences of a fixed random bigram process (same for every configuration)."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        successor = torch.randperm(USED_TOKENS, generator=gen)
        seq = torch.empty(n, GPT["seq"] + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, USED_TOKENS, (n,), generator=gen)
        follow = torch.rand(n, GPT["seq"], generator=gen) < FOLLOW
        noise = torch.randint(0, USED_TOKENS, (n, GPT["seq"]), generator=gen)
        for t in range(GPT["seq"]):
            seq[:, t + 1] = torch.where(follow[:, t], successor[seq[:, t]], noise[:, t])
        self.ids, self.labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def loss_floor() -> float:
    """The bigram process's entropy per token (nats): what a perfect model reaches."""
    p_hit = FOLLOW + (1 - FOLLOW) / USED_TOKENS
    p_miss = (1 - FOLLOW) / USED_TOKENS
    return -(p_hit * math.log(p_hit) + (USED_TOKENS - 1) * p_miss * math.log(p_miss))


def shrink_for_cpu() -> None:
    """``--tiny``: a small model on the CPU with torchao's emulated float8 (checks the plumbing, not speed)."""
    global STEPS, TIMED_FROM
    GPT.update(layers=2, hidden=64, heads=4, seq=64, batch=4, vocab=4096)
    STEPS, TIMED_FROM = 30, 5
    for spec in CONFIGS.values():   # compiled: inductor's CPU backend
        spec["steps"] = min(spec.get("steps", STEPS), STEPS)


def run_one(name: str, tiny: bool = False) -> dict:
    import lightning as L

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.quantization.float8 import Float8Config, enable_fp8
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    spec = CONFIGS[name]
    recipe, steps = spec.get("fp8"), min(spec.get("steps", STEPS), STEPS)
    fields = {k: spec[k] for k in ("compile", "compile_layers", "round_scales_to_power_of_2", "grouped_experts",
                                   "output_layer") if k in spec}
    marks = {}
    sync = (lambda: None) if tiny else torch.cuda.synchronize

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.losses = []
            self.converted = 0

        def configure_model(self) -> None:
            if hasattr(self, "model"):
                return
            g = GPT
            moe = None
            if "experts" in g:
                from lightning_megatron.moe import MoEConfig

                moe = MoEConfig(hidden_size=g["hidden"], ffn_hidden_size=g["expert_ffn"], num_experts=g["experts"],
                                topk=g["topk"], aux_loss_coeff=1e-2)
            cfg = TransformerConfig(num_layers=g["layers"], hidden_size=g["hidden"], num_attention_heads=g["heads"],
                                    hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh", moe=moe)
            self.model = GPTModel(cfg, g["vocab"], g["seq"])
            if recipe is not None:
                self.converted = len(enable_fp8(self.model, Float8Config(recipe, emulate=tiny, **fields)))
            elif fields.get("compile_layers"):
                for layer in self.model.decoder.layers:
                    layer.compile(dynamic=False)

        def training_step(self, batch, batch_idx):
            loss = self.model(batch["input_ids"], labels=batch["labels"]).mean()
            self.losses.append(loss.detach())
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = LR * min(1.0, (batch_idx + 1) / LR_WARMUP)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx in (0, TIMED_FROM):
                sync()
                marks[batch_idx] = time.perf_counter()

        def on_train_end(self, trainer, module):
            sync()
            marks["end"] = time.perf_counter()

    L.seed_everything(spec.get("seed", 0), verbose=False)
    module = Module()
    # the same STEPS batches for every configuration (shorter runs stop early)
    loader = torch.utils.data.DataLoader(BigramBatches(GPT["batch"] * STEPS), batch_size=GPT["batch"],
                                         drop_last=True)
    trainer = L.Trainer(accelerator="cpu" if tiny else "gpu", devices=1, strategy=MegatronStrategy(),
                        precision="bf16-true",
                        max_steps=steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(module, loader)
    from torch._dynamo.utils import counters
    return {"dynamo": {"unique_graphs": counters["stats"].get("unique_graphs", 0),
                       "graph_breaks": sum(counters["graph_break"].values()),
                       "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else None},
            "step_s": (marks["end"] - marks[TIMED_FROM]) / (steps - TIMED_FROM),
            "first_steps_s": marks[TIMED_FROM] - marks[0],
            "peak_gib": 0.0 if tiny else torch.cuda.max_memory_allocated() / 2**30,
            "converted": module.converted,
            "losses": torch.stack(module.losses).float().cpu().tolist()}


def windows(losses) -> list:
    return [sum(losses[i:i + WINDOW]) / WINDOW for i in range(0, len(losses) - WINDOW + 1, WINDOW)]


def plateau_exit(losses) -> str:
    """The first step after which the model predicts better than the unigram distribution by 0.5 nats (10-step
    mean below ln(4096) - 0.5): when it started using the bigrams. Float8 variants of the output layer differed
    from bf16 mostly here (benchmarks/RESULTS.md, sixteenth session)."""
    limit = math.log(USED_TOKENS) - 0.5
    exits = [i for i, w in enumerate(windows(losses)) if w < limit]
    return f"steps {exits[0] * WINDOW + 1}-{(exits[0] + 1) * WINDOW}" if exits else "not yet"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=list(CONFIGS), help="one configuration, run in this process")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset, in this order")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="wall-time budget of the whole run; configurations that do not fit are skipped")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU (emulated float8)")
    parser.add_argument("--shape", choices=list(SHAPES), default="1.3b", help="the model (default: the issue's)")
    parser.add_argument("--steps", type=int, help=f"at most this many steps per configuration (> {TIMED_FROM}); "
                        f"default {STEPS}")
    parser.add_argument("--log-dir", help="write each configuration's stderr to LOG_DIR/NAME.log")
    parser.add_argument("--json", help="write every configuration's results (losses included) to this file")
    args = parser.parse_args()
    GPT.update(SHAPES[args.shape])
    if args.tiny:
        shrink_for_cpu()
    if args.steps is not None:
        if args.steps <= TIMED_FROM:
            parser.error(f"--steps must be more than {TIMED_FROM} (the untimed first steps), got {args.steps}")
        for spec in CONFIGS.values():
            spec["steps"] = min(spec.get("steps", STEPS), args.steps)
    unknown = [n for n in args.configs.split(",") if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.tiny)), flush=True)
        return
    start = time.perf_counter()
    try:
        import torchao
        ao = torchao.__version__
    except ImportError:
        ao = "not installed"
    device = "CPU (--tiny)" if args.tiny else torch.cuda.get_device_name()
    print(f"device: {device}  torch {torch.__version__}  torchao {ao}  "
          f"GPT {GPT}  {STEPS} steps", flush=True)
    results = {}
    for name in args.configs.split(","):
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            print(f"{name}: SKIPPED (budget: {left:.0f} s left)", flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--only", name, "--shape", args.shape] + (
            ["--tiny"] if args.tiny else []) + (
            ["--steps", str(args.steps)] if args.steps is not None else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as err:
            tail = (err.stderr or b"")[-2000:]
            print(f"{name}: TIMEOUT after {left:.0f} s\n{tail.decode() if isinstance(tail, bytes) else tail}",
                  flush=True)
            continue
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            with open(os.path.join(args.log_dir, f"{name}.log"), "w") as f:
                f.write(proc.stderr)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not line:
            print(f"{name}: FAILED (rc {proc.returncode})\n{proc.stderr[-4000:]}", flush=True)
            continue
        r = results[name] = json.loads(line[-1][len("RESULT "):])
        print(f"{name}: {r['step_s'] * 1e3:.1f} ms/step, first {TIMED_FROM} steps {r['first_steps_s']:.1f} s, "
              f"process {time.perf_counter() - t0:.0f} s, {r['converted']} layers in fp8, dynamo {r['dynamo']}",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpt": GPT, "results": results}, f)

    tokens = GPT["batch"] * GPT["seq"]
    base = results.get("bf16")
    ref = windows(base["losses"]) if base else None
    print(f"\nloss floor of the data: {loss_floor():.3f}")
    print(f"\n| configuration | step ms | tokens/s | vs bf16 | first {TIMED_FROM} steps s | peak GiB | "
          f"loss steps 1-{WINDOW} | loss last {WINDOW} | max rel. diff of {WINDOW}-step mean loss vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        w = windows(r["losses"])
        speed = f"{base['step_s'] / r['step_s']:.3f}x" if base else "-"
        diff = "-"
        if ref and name != "bf16":
            n = min(len(w), len(ref))
            diff = f"{max(abs(a - b) / b for a, b in zip(w[:n], ref[:n])):.2%} (over {n * WINDOW} steps)"
        print(f"| {name} | {r['step_s'] * 1e3:.1f} | {tokens / r['step_s']:.0f} | {speed} | "
              f"{r['first_steps_s']:.1f} | {r['peak_gib']:.1f} | {w[0]:.4f} | {w[-1]:.4f} | {diff} |")
    print(f"\n{WINDOW}-step mean losses (and the window where each left the unigram plateau):")
    for name, r in results.items():
        print(f"  {name:<26} " + " ".join(f"{v:.3f}" for v in windows(r["losses"])) +
              f"   [{plateau_exit(r['losses'])}]")
    if ref:
        print(f"\nrelative difference of each {WINDOW}-step mean loss to bf16's (signed, %):")
        for name, r in results.items():
            if name != "bf16":
                print(f"  {name:<26} " + " ".join(f"{(a - b) / b:+.1%}" for a, b in zip(windows(r["losses"]), ref)))
    print(f"\ntotal {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
