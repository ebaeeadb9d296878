"""Multi-GPU scaling through the Trainer (the path users take): tensor, pipeline (1F1B, interleaved, zero-bubble),
data (distributed optimizer with overlapped reduce and gather), context and expert parallelism.

Workloads (bf16-true, fused AdamW, gradient clipping at 1.0, the loss logged every step as users do):
- ``gpt``: the ~1.3B GPT (24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary 50304, no dropout);
- ``llama``: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV groups, FFN 8192, sequence
  4096, vocabulary 128256), for the pipeline split: its output layer and loss cost about four layers;
- ``moe``: a small MoE GPT (12 layers, hidden 1024, 16 heads, sequence 4096, 8 experts top-2 on every
  layer, expert FFN 2816, auxiliary loss 1e-2, dropless), at 4 sequences per GPU: data parallel, and expert
  parallel (EP = GPUs) with ECHO's spare slots off and on (``-echo``), under balanced routing and under routing
  skewed towards the first EP rank's experts by a selection bias (``-skew``): ECHO against off, same routing.

Each configuration runs in its own processes (``torchrun --standalone`` above one GPU). Rank 0 times steps
W..W+N between two marks of ``cuda.synchronize`` + barrier on every rank; then every rank profiles P more
steps and sums the GPU time of its compute kernels (all but NCCL's): the pipeline's ideal step is that
per-micro-batch stage compute, the slowest stage's, times (m + p - 1) - the bubble (p - 1)/(m + p - 1).

    python benchmarks/bench_scaling.py --gpus 2                   # every configuration for 2 GPUs, then tables
    python benchmarks/bench_scaling.py --gpus 2 --groups tp,dp    # some groups: tp, dp, pp, moe, balance, cp
    python benchmarks/bench_scaling.py --gpus 2 --tiny --accelerator cpu   # dry run of the machinery (gloo)
    BENCH_SCALING_GAPS=1 python benchmarks/bench_scaling.py --gpus 2 --only llama-pp2-m8   # + idle gaps, top kernels
    BENCH_SCALING_CUDA_GRAPH=partial python benchmarks/bench_scaling.py --gpus 2 --only moe-ep2,moe-ep2-echo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from timing import gpu_busy_ms, idle_gaps, kernel_ms_by_name   # benchmarks/timing.py (this folder is on sys.path when run as a script)

NOMINAL_PEAK = 790e12
GPT = dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304)
LLAMA = dict(layers=16, hidden=2048, heads=32, groups=8, ffn=8192, seq=4096, vocab=128256)
MOE = dict(layers=12, hidden=1024, heads=16, seq=4096, vocab=50304, experts=8, topk=2, expert_ffn=2816)
TINY = {"gpt": dict(layers=4, hidden=64, heads=4, seq=64, vocab=256),
        "llama": dict(layers=4, hidden=64, heads=4, groups=2, ffn=128, seq=64, vocab=4096),
        "moe": dict(layers=2, hidden=64, heads=4, seq=64, vocab=256, experts=4, topk=2, expert_ffn=96)}
WARMUP, STEPS, PROFILED = 3, 8, 2
SKEW = 1.0   # the skewed MoE layouts' selection bias (bench_echo.py's strongest: the busiest EP rank ~1.6x the mean)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    group: str
    workload: str
    gpus: int
    global_batch: int
    micro_batch: int
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    sp: bool = False
    distopt: bool = False
    split: Optional[str] = None   # the model's pipeline_layout (None: its default, balanced by cost; "9,7": by hand)
    schedule: str = "1f1b"        # the strategy's pipeline_schedule ("zb-h1": zero-bubble 1F1B)
    spare: int = 0                # MoE: ECHO's spare expert slots per EP rank (0: off)
    skew: float = 0.0             # MoE: selection bias on the first EP rank's experts (0: balanced routing)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)


def layouts(gpus: int) -> List[Layout]:
    """Strong scaling for TP (global batch 8), 1F1B/interleaved at m = 4, 8, 16 (micro-batch 2), weak scaling
    for DP (8 samples per replica), and the MoE layouts at 8 sequences of 4096 per step."""
    out = [Layout("gpt-1gpu", "tp,dp", "gpt", 1, 8, 4)]
    for n in (2, 4):
        if n > gpus:
            continue
        out += [Layout(f"gpt-tp{n}", "tp", "gpt", n, 8, 4, tp=n),
                Layout(f"gpt-tp{n}-sp", "tp", "gpt", n, 8, 4, tp=n, sp=True),
                Layout(f"gpt-dp{n}", "dp", "gpt", n, 8 * n, 4, distopt=True)]
        for m in (4, 8, 16):
            out += [Layout(f"gpt-pp{n}-m{m}", "pp", "gpt", n, 2 * m, 2, pp=n),
                    Layout(f"gpt-pp{n}-vpp2-m{m}", "pp", "gpt", n, 2 * m, 2, pp=n, vpp=2),
                    Layout(f"gpt-pp{n}-zb-m{m}", "pp", "gpt", n, 2 * m, 2, pp=n, schedule="zb-h1")]
    # the pipeline split (issue 30): 8 sequences of 4096 as 8 micro-batches of 1, default (balanced) vs even
    out.append(Layout("llama-1gpu", "balance", "llama", 1, 8, 1))
    for n in (2, 4):
        if n <= gpus:
            for vpp in (None, 2):
                name = f"llama-pp{n}" + (f"-vpp{vpp}" if vpp else "") + "-m8"
                out += [Layout(name, "balance", "llama", n, 8, 1, pp=n, vpp=vpp),
                        Layout(name + "-even", "balance", "llama", n, 8, 1, pp=n, vpp=vpp, split="even")]
            out.append(Layout(f"llama-pp{n}-zb-m8", "balance", "llama", n, 8, 1, pp=n, schedule="zb-h1"))
    if gpus >= 2:   # the neighbour of the balanced [10, 6], by hand; context parallelism at the Llama shape
        out += [Layout("llama-pp2-m8-9-7", "balance", "llama", 2, 8, 1, pp=2, split="9,7"),
                Layout("llama-cp2", "cp", "llama", 2, 8, 1, cp=2)]
    out.append(Layout("moe-1gpu", "moe", "moe", 1, 4, 2))
    if gpus >= 2:
        out += [Layout("moe-dp2", "moe", "moe", 2, 8, 2),
                Layout("moe-cp2", "moe", "moe", 2, 8, 2, cp=2),
                Layout("moe-cp2-ep2", "moe", "moe", 2, 8, 2, cp=2, ep=2)]
    for n in (2, 4):   # expert parallelism with ECHO off and on, balanced and skewed routing (issue 30)
        if n <= gpus:
            if n > 2:
                out.append(Layout(f"moe-dp{n}", "moe", "moe", n, 4 * n, 2))
            for skew in (0.0, SKEW):
                for spare in (0, 1):
                    name = f"moe-ep{n}" + ("-skew" if skew else "") + ("-echo" if spare else "")
                    out.append(Layout(name, "moe", "moe", n, 4 * n, 2, ep=n, spare=spare, skew=skew))
    return out


# -- one configuration, in each of its processes ----------------------------------------------------------------

def count_echo_decisions() -> Dict[str, Any]:
    """Counts of ECHO's decisions in this process's MoE layer forwards (``moe/echo_schedule.py``): forwards that
    planned (and how many of them put tokens on spare slots), forwards that did not (and how many of those saw an
    EP rank beyond the tolerance; each one's busiest EP rank over the mean), filled as the run goes."""
    from lightning_megatron.moe.echo import any_rank_spills
    from lightning_megatron.moe.echo_schedule import EchoSchedule

    counts: Dict[str, Any] = dict(planned=0, slots_used=0, unplanned=0, would_spill=0, busiest_over_mean=[])
    saw_plan, saw_loads = EchoSchedule.saw_plan, EchoSchedule.saw_loads

    def planned(self, slots_used):
        counts["planned"] += 1
        counts["slots_used"] += bool(slots_used)
        return saw_plan(self, slots_used)

    def unplanned(self, rows, tolerance):
        counts["unplanned"] += 1
        if rows is not None:
            counts["would_spill"] += bool(any_rank_spills(rows, tolerance))
            counts["busiest_over_mean"].append(max(rows) * len(rows) / max(sum(rows), 1))
        return saw_loads(self, rows, tolerance)

    EchoSchedule.saw_plan, EchoSchedule.saw_loads = planned, unplanned   # (this configuration's processes only)
    return counts


def transformer_config(workload: str, tiny: bool, spare: int = 0):
    from lightning_megatron.moe import MoEConfig
    from lightning_megatron.transformer import TransformerConfig

    spec = (TINY if tiny else {"gpt": GPT, "llama": LLAMA, "moe": MOE})[workload]
    if workload == "llama":
        from lightning_megatron.models.llama import llama_config

        return llama_config(spec["layers"], spec["hidden"], spec["heads"], num_query_groups=spec["groups"],
                            ffn_hidden_size=spec["ffn"]), spec
    moe = None
    if workload == "moe":
        # the expert bias (selection only) is what skews the routing of the skewed layouts; zero leaves it unchanged
        moe = MoEConfig(hidden_size=spec["hidden"], ffn_hidden_size=spec["expert_ffn"], num_experts=spec["experts"],
                        topk=spec["topk"], aux_loss_coeff=1e-2, enable_expert_bias=True,
                        num_spare_experts_per_ep_rank=spare)
    return TransformerConfig(num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
                             hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh", moe=moe), spec


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq + 1), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def run_layout(layout: Layout, accelerator: str, tiny: bool, out_path: str) -> None:
    import lightning as L
    import torch.distributed as dist

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.models import GPTModel
    from lightning_megatron.models.llama import LlamaModel
    from lightning_megatron.pipeline import VirtualChunks

    config, spec = transformer_config(layout.workload, tiny, layout.spare)
    gpu = accelerator == "gpu"
    echo = count_echo_decisions() if layout.spare else None
    split = [int(n) for n in layout.split.split(",")] if layout.split and "," in layout.split else layout.split
    marks: Dict[str, object] = {}

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                model_class = LlamaModel if layout.workload == "llama" else GPTModel
                self.model = VirtualChunks(lambda v: model_class(config, spec["vocab"], spec["seq"], vp_rank=v,
                                                                 pipeline_layout=split))
                if layout.skew:   # the first EP rank's experts (global ids) picked more often: its GPU the busiest
                    from lightning_megatron.moe import TopKRouter

                    for router in (m for m in self.model.modules() if isinstance(m, TopKRouter)):
                        router.expert_bias[: spec["experts"] // layout.ep] = layout.skew

        def forward(self, batch):   # pipeline stages after the first run it on the received activation
            return self.model(batch["input_ids"], labels=batch["labels"])

        def training_step(self, batch, batch_idx):
            loss = self(batch).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=gpu)

    def mark() -> float:
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter()

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == WARMUP:
                marks["start"] = mark()
            elif batch_idx == WARMUP + STEPS:
                marks["end"] = mark()
                if gpu:
                    from torch.profiler import ProfilerActivity, profile

                    marks["profiler"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    marks["profiler"].__enter__()

        def on_train_end(self, trainer, module):
            if gpu:
                torch.cuda.synchronize()
                marks["profiler"].__exit__(None, None, None)
                marks["compute_ms"] = gpu_busy_ms(marks["profiler"], PROFILED, skip=("nccl",))
                if os.environ.get("BENCH_SCALING_GAPS") == "1":   # where each rank's GPU waits, per step
                    marks["gaps"] = dict(idle_gaps(marks["profiler"], PROFILED, at_least_us=100.0),
                                         kernels_ms=kernel_ms_by_name(marks["profiler"], PROFILED))

    strategy = MegatronStrategy(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
                                expert_model_parallel_size=layout.ep, sequence_parallel=layout.sp,
                                micro_batch_size=layout.micro_batch, pipeline_schedule=layout.schedule,
                                use_distributed_optimizer=layout.distopt,
                                overlap_grad_reduce=layout.distopt, overlap_param_gather=layout.distopt,
                                # BENCH_SCALING_COMPILE=0/1: compile_layers False/True (default "auto")
                                compile_layers={"0": False, "1": True}.get(os.environ.get("BENCH_SCALING_COMPILE", ""),
                                                                           "auto"),
                                # BENCH_SCALING_CUDA_GRAPH=partial/full: the strategy's cuda_graph (default None)
                                cuda_graph=os.environ.get("BENCH_SCALING_CUDA_GRAPH") or None)
    torch.manual_seed(0)
    steps = WARMUP + STEPS + PROFILED
    per_rank = layout.global_batch // layout.dp
    data = torch.utils.data.DataLoader(Tokens(layout.global_batch * steps, spec["seq"], spec["vocab"]),
                                       batch_size=per_rank, drop_last=True)
    trainer = L.Trainer(accelerator=accelerator, devices=layout.gpus, strategy=strategy,
                        precision="bf16-true" if gpu else "32-true", max_steps=steps, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(Module(), data)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (marks.get("compute_ms"), marks.get("gaps")))
    gathered, gaps = [c for c, _ in gathered], [g for _, g in gathered]
    if trainer.is_global_zero:
        chunk = trainer.lightning_module.model.chunks[0]
        result = {"layout": dataclasses.asdict(layout), "step_s": (marks["end"] - marks["start"]) / STEPS,
                  "pipeline_layout": list(chunk.pipeline_layout),
                  "compute_ms_per_rank": gathered,
                  **({"idle_gaps_per_rank": gaps} if any(g is not None for g in gaps) else {}),
                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
                  "final_loss": float(trainer.callback_metrics["train_loss"]),
                  **({"echo_forwards": echo} if echo is not None else {})}
        with open(out_path, "w") as f:
            json.dump(result, f)
    # Every group goes before the interpreter does: a rank that exited with live gloo groups while its peer
    # was still writing aborted once in CI ("terminate called without an active exception", SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------------------------

def launch(layout: Layout, args, out_path: str) -> Optional[dict]:
    script = [os.path.abspath(__file__), "--gpus", str(args.gpus), "--accelerator", args.accelerator] + (
        ["--tiny"] if args.tiny else [])
    env = dict(os.environ, BENCH_SCALING_LAYOUT=layout.name, BENCH_SCALING_OUT=out_path)   # torchrun eats --run
    if layout.gpus == 1:
        command = [sys.executable] + script
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={layout.gpus}"] + script
    start = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True, env=env)
    except subprocess.TimeoutExpired:
        print(f"{layout.name}: timed out after {args.timeout} s", flush=True)
        return None
    if done.returncode != 0 or not os.path.exists(out_path):
        print(f"{layout.name}: failed (rc {done.returncode})\n{done.stderr[-3000:]}", flush=True)
        return None
    with open(out_path) as f:
        result = json.load(f)
    print(f"{layout.name}: {result['step_s'] * 1e3:.1f} ms/step ({time.perf_counter() - start:.0f} s)", flush=True)
    for rank, gaps in enumerate(result.get("idle_gaps_per_rank") or []):
        print(f"{layout.name} rank {rank} idle: {json.dumps(gaps)}", flush=True)
    return result


def flops_per_step(layout: Layout, tiny: bool) -> float:
    from lightning_megatron.transformer.flops import training_flops_per_sequence

    config, spec = transformer_config(layout.workload, tiny)
    return layout.global_batch * training_flops_per_sequence(config, spec["seq"], spec["vocab"])


def tables(results: Dict[str, dict], tiny: bool, peak: float) -> str:
    lines = []
    rows = {name: r for name, r in results.items() if r is not None}

    def throughput(r: dict) -> str:
        layout = Layout(**r["layout"])
        tokens = layout.global_batch * (TINY if tiny else {"gpt": GPT, "llama": LLAMA, "moe": MOE})[layout.workload]["seq"]
        mfu = flops_per_step(layout, tiny) / r["step_s"] / layout.gpus
        return (f"{r['step_s'] * 1e3:9.1f} | {tokens / r['step_s']:10.0f} | {mfu / 1e12:6.1f} | {mfu / peak:5.1%} | "
                f"{mfu / NOMINAL_PEAK:5.1%}")

    header = "| layout | GPUs | step ms | tokens/s | TFLOP/s/GPU | MFU (measured peak) | MFU (790) |"
    one = rows.get("gpt-1gpu")
    lines += ["### Tensor parallelism, strong scaling (GPT-1.3B, global batch 8, micro-batch 4)", "",
              header + " speed-up | efficiency |", "|" + " --- |" * 9]
    for name, r in rows.items():
        layout = Layout(**r["layout"])
        if name == "gpt-1gpu" or (layout.group == "tp"):
            speedup = one["step_s"] / r["step_s"] if one else float("nan")
            lines.append(f"| {name} | {layout.gpus} | {throughput(r)} | {speedup:.2f}x | {speedup / layout.gpus:.1%} |")
    lines += ["", "### Data parallelism, weak scaling (8 sequences per replica; distributed optimizer, overlapped "
              "reduce-scatter and all-gather)", "", header + " efficiency |", "|" + " --- |" * 8]
    for name, r in rows.items():
        layout = Layout(**r["layout"])
        if name == "gpt-1gpu" or layout.group == "dp":
            eff = one["step_s"] / r["step_s"] if one else float("nan")
            lines.append(f"| {name} | {layout.gpus} | {throughput(r)} | {eff:.1%} |")
    lines += ["", "### Pipeline bubble (GPT-1.3B, micro-batch 2, m micro-batches per step)", "",
              "ideal = slowest stage's compute per micro-batch x (m + (p - 1)/vpp); compute = GPU time of "
              "every non-NCCL kernel per step on that rank (optimizer included), profiled over "
              f"{PROFILED} steps", "",
              "| layout | m | step ms | compute ms per rank | ideal ms | step / ideal | bubble measured | "
              "bubble ideal | tokens/s | MFU (measured peak) |", "|" + " --- |" * 10]
    for name, r in rows.items():
        layout = Layout(**r["layout"])
        if layout.group != "pp":
            continue
        m, p = layout.micro_batches, layout.pp
        compute = r["compute_ms_per_rank"]
        if all(c is not None for c in compute):
            stage = [c for c in compute]   # one rank per stage here (dp = tp = 1)
            v = layout.vpp or 1   # interleaving: the fill and drain take (p - 1)/v stage-micro-batches
            ideal_ms = max(stage) / m * (m + (p - 1) / v)
            step_ms = r["step_s"] * 1e3
            # zero-bubble with equal F, B and W times: p - 1 of 3m + p - 1 (ideal_ms stays 1F1B's ideal)
            ideal_bubble = (p - 1) / (3 * m + p - 1) if layout.schedule == "zb-h1" else (p - 1) / (v * m + p - 1)
            measured_bubble = 1 - max(stage) / step_ms
            cells = (f"{' / '.join(f'{c:.1f}' for c in stage)} | {ideal_ms:.1f} | {step_ms / ideal_ms:.3f} | "
                     f"{measured_bubble:.1%} | {ideal_bubble:.1%}")
        else:
            cells = "- | - | - | - | -"
        tokens = layout.global_batch * (TINY["gpt"] if tiny else GPT)["seq"] / r["step_s"]
        mfu = flops_per_step(layout, tiny) / r["step_s"] / layout.gpus / peak
        lines.append(f"| {name} | {m} | {r['step_s'] * 1e3:.1f} | {cells} | {tokens:.0f} | {mfu:.1%} |")
    lines += ["", "### Pipeline split (Llama-3.2-1B shape, sequence 4096, 8 micro-batches of 1): the default "
              "(balanced by cost) against the even split", "",
              "ideal = one GPU's step / p x (m + (p - 1)/vpp) / m", "",
              "| layout | split | step ms | ideal ms | step / ideal | compute ms per rank | MFU (measured peak) | "
              "peak GiB |", "|" + " --- |" * 8]
    single = rows.get("llama-1gpu")
    for name, r in rows.items():
        layout = Layout(**r["layout"])
        if layout.group != "balance":
            continue
        m, p, v = layout.micro_batches, layout.pp, layout.vpp or 1
        ideal = single["step_s"] * 1e3 / p * (m + (p - 1) / v) / m if single else float("nan")
        compute = " / ".join("-" if c is None else f"{c:.1f}" for c in r["compute_ms_per_rank"])
        mfu = flops_per_step(layout, tiny) / r["step_s"] / layout.gpus / peak
        lines.append(f"| {name} | {r.get('pipeline_layout')} | {r['step_s'] * 1e3:.1f} | {ideal:.1f} | "
                     f"{r['step_s'] * 1e3 / ideal:.3f} | {compute} | {mfu:.1%} | {r['peak_gib'] or 0:.1f} |")
    cp_rows = {name: r for name, r in rows.items() if Layout(**r["layout"]).group == "cp"}
    if cp_rows:
        lines += ["", "### Context parallelism at the Llama shape (each rank a share of every sequence)", "",
                  "| layout | step ms | speed vs llama-1gpu | compute ms per rank | MFU (measured peak) | peak GiB |",
                  "|" + " --- |" * 6]
        for name, r in cp_rows.items():
            layout = Layout(**r["layout"])
            rel = f"{single['step_s'] / r['step_s']:.2f}x" if single else "-"
            compute = " / ".join("-" if c is None else f"{c:.1f}" for c in r["compute_ms_per_rank"])
            mfu = flops_per_step(layout, tiny) / r["step_s"] / layout.gpus / peak
            lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} | {rel} | {compute} | {mfu:.1%} | "
                         f"{r['peak_gib'] or 0:.1f} |")
    lines += ["", "### MoE GPT (12 layers, hidden 1024, 8 experts top-2, sequence 4096, 4 sequences per GPU per step; "
              f"skewed: expert bias {SKEW} on the first EP rank's experts; ECHO: one spare slot per EP rank)", "",
              header + " vs moe-dp (same GPUs) | ECHO vs off |", "|" + " --- |" * 9]
    for name, r in rows.items():
        layout = Layout(**r["layout"])
        if layout.group != "moe":
            continue
        speed = layout.global_batch / r["step_s"]
        base = rows.get(f"moe-dp{layout.gpus}")
        rel = f"{speed / (base['layout']['global_batch'] / base['step_s']):.2f}x" if base and layout.gpus > 1 else "-"
        off = rows.get(name[:-len("-echo")]) if name.endswith("-echo") else None
        echo = f"{off['step_s'] / r['step_s']:.2f}x" if off else "-"
        lines.append(f"| {name} | {layout.gpus} | {throughput(r)} | {rel} | {echo} |")
    lines += ["", "final losses: " + ", ".join(f"{n} {r['final_loss']:.4f}" for n, r in rows.items())]
    for name, r in rows.items():
        if r.get("echo_forwards"):
            e = r["echo_forwards"]
            ratio = f", busiest EP rank / mean {sum(e['busiest_over_mean']) / len(e['busiest_over_mean']):.2f}" \
                if e["busiest_over_mean"] else ""
            lines.append(f"ECHO in {name} (MoE layer forwards, all steps, rank 0): {e['planned']} planned "
                         f"({e['slots_used']} put tokens on spare slots), {e['unplanned']} unplanned "
                         f"({e['would_spill']} beyond the tolerance{ratio})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--groups", default="tp,dp,pp,moe")
    parser.add_argument("--only", default=None, help="comma-separated layout names")
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny models (a dry run of the machinery)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    parser.add_argument("--json", default=None, help="also write every result to this file")
    parser.add_argument("--tables-from", default=None, help="print the tables of a --json file and stop")
    args = parser.parse_args()
    if args.tables_from:
        with open(args.tables_from) as f:
            saved = json.load(f)
        print(tables(saved["results"], args.tiny, saved["peak"]))
        return
    known = {layout.name: layout for layout in layouts(args.gpus)}
    if os.environ.get("BENCH_SCALING_LAYOUT"):   # one configuration's process (see launch)
        run_layout(known[os.environ["BENCH_SCALING_LAYOUT"]], args.accelerator, args.tiny,
                   os.environ["BENCH_SCALING_OUT"])
        return
    groups = set(args.groups.split(","))
    chosen = ([known[n] for n in args.only.split(",")] if args.only else
              [layout for layout in known.values() if groups & set(layout.group.split(","))])
    peak = NOMINAL_PEAK
    if args.accelerator == "gpu":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_gpt import measured_peak

        peak = measured_peak()
        torch.cuda.empty_cache()
        print(f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}, "
              f"measured bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in chosen:
            results[layout.name] = launch(layout, args, os.path.join(tmp, layout.name + ".json"))
            if args.json:   # after every configuration: a call cut short keeps what it measured (--tables-from)
                with open(args.json, "w") as f:
                    json.dump({"peak": peak, "results": results}, f, indent=1)
    print(tables(results, args.tiny, peak))


if __name__ == "__main__":
    main()
