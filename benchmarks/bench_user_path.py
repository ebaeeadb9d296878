"""The path users take, side by side on one GPU: plain PyTorch loop, the same model under Lightning
``strategy="auto"``, and ``MegatronStrategy`` through the Trainer (eager, ``cuda_graph="partial"`` per layer and
with ``cuda_graph_scope="block"``, ``"full"``); for BERT-base also a plain whole-step ``torch.cuda.graph``
(Hugging Face BERT, the graph a user would write by hand) and the plain loop over that same Hugging Face model.

Workloads (bf16-true, fused AdamW, gradient clipping at 1.0 on every path, batches from a DataLoader
of CPU tensors moved to the GPU by each path):
- ``gpt``: 24 layers, hidden 2048, 16 heads, sequence 2048, micro-batch 4, vocabulary 50304, no dropout;
- ``bert``: BERT-base (12 layers, hidden 768), micro-batch 4, sequence 128, dropout 0.1, 3 labels.

Each configuration runs in its own process; a step's time is the wall time from step W to step W+N
with one ``cuda.synchronize`` at each end (host work included). MFU uses 6·N + 12·L·S·H FLOPs per
token against the bf16 matmul peak measured in the same run and the nominal 790 TFLOP/s.
``--profile`` also counts per-step host syncs and CPU time of our eager path with torch.profiler.

    python benchmarks/bench_user_path.py                  # everything, then the table
    python benchmarks/bench_user_path.py --only gpt/ours-eager
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench_gpt import NOMINAL_PEAK, measured_peak   # the same peak measurement as the model benchmark
from timing import gpu_busy_ms, gpu_kernels
GPT = dict(layers=24, hidden=2048, heads=16, seq=2048, batch=4, vocab=50304)
BERT = dict(layers=12, hidden=768, heads=12, seq=128, batch=4, vocab=30522, labels=3)
# Llama-3.2-1B's shape (tied embeddings, 8 kv heads) at sequence 4096
LLAMA = dict(layers=16, hidden=2048, heads=32, kv=8, ffn=8192, seq=4096, batch=1, vocab=128256, rope_base=500000.0)
CONFIGS = ["gpt/plain", "gpt/auto", "gpt/ours-eager", "llama/plain", "llama/plain-hf", "llama/ours-eager",
           "bert/plain-hf", "bert/plain-hf-graph", "bert/plain", "bert/auto", "bert/ours-eager",
           "bert/ours-partial", "bert/ours-partial-block", "bert/ours-full",
           "bert/ours-full-compiled", "gpt8/ours-eager", "gpt8/ours-eager-fusedce"]
# gpt8: the GPT at micro-batch 8, where the loss's float32 logits are largest (the fused chunked loss's case)
GPT8 = dict(GPT, batch=8)
FUSED_CE_CHUNK = 4096   # "ours-eager-fusedce": GPTModel(..., cross_entropy_chunk_size=4096)
SPECS = {"gpt": GPT, "gpt8": GPT8, "bert": BERT, "llama": LLAMA}
WARMUP = {"gpt": (5, 20), "gpt8": (3, 10), "bert": (20, 100), "llama": (3, 12)}   # (warm-up steps, timed steps)


# -- models and data -------------------------------------------------------------------------------------------

def llama_config():
    from lightning_megatron.models.llama import llama_config as make

    g = LLAMA
    return make(g["layers"], g["hidden"], g["heads"], num_query_groups=g["kv"], ffn_hidden_size=g["ffn"],
                rotary_base=g["rope_base"])


def build_model(workload: str, cross_entropy_chunk_size=None):
    from lightning_megatron.models import BertForSequenceClassification, GPTModel
    from lightning_megatron.transformer import TransformerConfig

    if workload == "llama":
        from lightning_megatron.models.llama import LlamaModel

        return LlamaModel(llama_config(), LLAMA["vocab"], LLAMA["seq"], tie_word_embeddings=True)

    if workload in ("gpt", "gpt8"):
        g = GPT
        cfg = TransformerConfig(num_layers=g["layers"], hidden_size=g["hidden"], num_attention_heads=g["heads"],
                                hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh")
        return GPTModel(cfg, g["vocab"], g["seq"], cross_entropy_chunk_size=cross_entropy_chunk_size)
    b = BERT
    cfg = TransformerConfig(num_layers=b["layers"], hidden_size=b["hidden"], num_attention_heads=b["heads"],
                            layernorm_order="post", attn_mask_type="padding", hidden_dropout=0.1,
                            attention_dropout=0.1)
    return BertForSequenceClassification(cfg, b["vocab"], b["labels"])


def loss_of(workload: str, model, batch):
    import torch.nn.functional as F

    if workload in ("gpt", "gpt8", "llama"):
        return model(batch["input_ids"], labels=batch["labels"]).mean()
    return F.cross_entropy(model(batch["input_ids"]).float(), batch["labels"])


class Batches(torch.utils.data.Dataset):
    def __init__(self, workload: str, n: int) -> None:
        spec = SPECS[workload]
        # one generator per tensor: sample i is the same whatever n, so every path trains on the same batches
        ids, labels = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        self.ids = torch.randint(5, spec["vocab"], (n, spec["seq"]), generator=ids)
        self.labels = (torch.randint(0, spec["vocab"], (n, spec["seq"]), generator=labels) if workload != "bert"
                       else torch.randint(0, BERT["labels"], (n,), generator=labels))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def loader(workload: str, steps: int):
    spec = SPECS[workload]
    return torch.utils.data.DataLoader(Batches(workload, spec["batch"] * steps), batch_size=spec["batch"],
                                       drop_last=True)


def world_of_one() -> None:
    """A one-rank process group and ParallelState: what our layers need outside the strategy."""
    import torch.distributed as dist

    from lightning_megatron.parallel import ParallelLayout, ParallelState

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    ParallelState(ParallelLayout(1)).activate()


# -- the paths -------------------------------------------------------------------------------------------------

def run_plain(workload: str, hf: bool = False, graph: bool = False, profile: bool = False) -> dict:
    warmup, steps = WARMUP[workload]
    torch.manual_seed(0)
    if hf and workload == "llama":   # the same Llama in Hugging Face transformers, SDPA attention
        from transformers import LlamaConfig, LlamaForCausalLM

        g = LLAMA
        hf_model = LlamaForCausalLM(LlamaConfig(
            vocab_size=g["vocab"], hidden_size=g["hidden"], intermediate_size=g["ffn"], num_hidden_layers=g["layers"],
            num_attention_heads=g["heads"], num_key_value_heads=g["kv"], max_position_embeddings=g["seq"],
            rope_theta=g["rope_base"], tie_word_embeddings=True, attn_implementation="sdpa")).cuda().to(torch.bfloat16)
        model = hf_model

        def step_loss(batch):
            return hf_model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    elif hf:
        from transformers import BertConfig, BertForSequenceClassification as HFBert

        config = BertConfig(num_labels=BERT["labels"], attn_implementation="sdpa")
        hf_model = HFBert(config).cuda().to(torch.bfloat16)
        model = hf_model

        def step_loss(batch):
            import torch.nn.functional as F
            return F.cross_entropy(hf_model(input_ids=batch["input_ids"]).logits.float(), batch["labels"])
    else:
        world_of_one()
        model = build_model(workload).cuda().to(torch.bfloat16)

        def step_loss(batch):
            return loss_of(workload, model, batch)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=graph)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch):
        loss = step_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=not graph)
        return loss.detach()

    data = iter(loader(workload, warmup + steps + 1))
    if graph:   # the whole step in one graph, on static input tensors (a first batch for the capture)
        static = {k: v.cuda() for k, v in next(data).items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(static)
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            static_loss = step(static)

        def step(batch):   # noqa: F811 - the graphed step
            for key, value in batch.items():
                static[key].copy_(value, non_blocking=True)
            cuda_graph.replay()
            return static_loss
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
            profiler = start_profiler() if profile else None
        batch = {k: v.cuda(non_blocking=True) for k, v in next(data).items()}
        loss = step(batch)
    torch.cuda.synchronize()
    out = {"step_s": (time.perf_counter() - start) / steps, "final_loss": float(loss),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if profile:
        out["profile"] = stop_profiler(profiler, steps)
    return out


def run_lightning(workload: str, strategy_name: str, cuda_graph=None, profile: bool = False,
                  cprofile: bool = False, steps=None, cross_entropy_chunk_size=None, compile_layers="auto",
                  cuda_graph_scope="layer") -> dict:
    """``cprofile``: Python's profiler over the timed steps (``out["cprofile"]``, a ``pstats.Stats``)."""
    import lightning as L

    warmup, default_steps = WARMUP[workload]
    steps = steps or default_steps
    marks = {}

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = build_model(workload, cross_entropy_chunk_size)

        def training_step(self, batch, batch_idx):
            loss = loss_of(workload, self.model, batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                torch.cuda.synchronize()
                marks["start"] = time.perf_counter()
                if profile:
                    marks["profiler"] = start_profiler()
                if cprofile:
                    import cProfile

                    marks["cprofile"] = cProfile.Profile()
                    marks["cprofile"].enable()

        def on_train_end(self, trainer, module):
            if cprofile:
                marks["cprofile"].disable()
            torch.cuda.synchronize()
            marks["end"] = time.perf_counter()
            if profile:
                marks["profile"] = stop_profiler(marks["profiler"], steps)

    if strategy_name == "auto":
        world_of_one()
        strategy = "auto"
    else:
        from lightning_megatron import MegatronStrategy

        strategy = MegatronStrategy(cuda_graph=cuda_graph, cuda_graph_warmup_steps=3, compile_layers=compile_layers,
                                    cuda_graph_scope=cuda_graph_scope)
    torch.manual_seed(0)
    module = Module()
    # use_distributed_sampler=False: Lightning shuffles the training set of every distributed strategy (ours and
    # DDP) through its DistributedSampler; the plain loop and "auto" read it in order, and the final losses
    # are compared on the same batches
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-true",
                        use_distributed_sampler=False, max_steps=warmup + steps, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()])
    trainer.fit(module, loader(workload, warmup + steps))
    out = {"step_s": (marks["end"] - marks["start"]) / steps,
           "final_loss": float(trainer.callback_metrics["train_loss"]),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if profile:
        out["profile"] = marks["profile"]
    if cprofile:
        import pstats

        out["cprofile"] = pstats.Stats(marks["cprofile"])
    return out


def start_profiler():
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def stop_profiler(prof, steps: int) -> dict:
    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    counts = {}
    for event in prof.key_averages():
        if event.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                         "aten::_local_scalar_dense", "aten::item", "cudaMemcpyAsync", "cudaLaunchKernel",
                         "cudaGraphLaunch", "Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pageable)"):
            counts[event.key] = event.count / steps
    kernels = {}   # kernels and copies as the GPU ran them: name -> (ms per step, calls per step)
    for name, start, stop in gpu_kernels(prof):
        ms, calls = kernels.get(name[:80], (0.0, 0.0))
        kernels[name[:80]] = (ms + (stop - start) / 1e3 / steps, calls + 1 / steps)
    counts["gpu_ms_per_step"] = round(gpu_busy_ms(prof, steps), 3)
    counts["kernels"] = {name: (round(ms, 4), calls) for name, (ms, calls) in kernels.items()}
    return counts


def run_one(name: str, profile: bool) -> dict:
    workload, path = name.split("/")
    if path == "plain":
        return run_plain(workload, profile=profile)
    if path == "plain-hf":
        return run_plain(workload, hf=True)
    if path == "plain-hf-graph":
        return run_plain(workload, hf=True, graph=True)
    if path == "auto":
        return run_lightning(workload, "auto")
    if path == "ours-eager-fusedce":
        return run_lightning(workload, "megatron", None, cross_entropy_chunk_size=FUSED_CE_CHUNK)
    if path == "ours-partial-block":   # the chunk's layers in one graph: one replay a micro-batch
        return run_lightning(workload, "megatron", "partial", cuda_graph_scope="block")
    if path == "ours-full-compiled":   # compiled layers inside the whole-step graph ("auto" leaves them eager)
        return run_lightning(workload, "megatron", "full", compile_layers=True)
    graph = {"ours-eager": None, "ours-partial": "partial", "ours-full": "full"}[path]
    return run_lightning(workload, "megatron", graph, profile=profile and path == "ours-eager")


def compare_profiles(a: dict, b: dict) -> None:
    """Kernels whose per-step GPU time or count differs between two profiles (what the slower path adds)."""
    ka, kb = a["kernels"], b["kernels"]
    keys = sorted(set(ka) | set(kb), key=lambda k: -abs(kb.get(k, (0, 0))[0] - ka.get(k, (0, 0))[0]))
    for key in keys[:15]:
        (ta, ca), (tb, cb) = ka.get(key, (0, 0)), kb.get(key, (0, 0))
        print(f"  {tb - ta:+8.3f} ms  {cb - ca:+7.1f} calls  {key}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help="one configuration (e.g. gpt/ours-eager), run in this process")
    parser.add_argument("--profile", action="store_true", help="count host syncs and kernel launches per step")
    parser.add_argument("--workloads", default="gpt,gpt8,bert,llama")
    parser.add_argument("--configs", help="comma-separated subset of " + ",".join(CONFIGS))
    args = parser.parse_args()
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only, args.profile)), flush=True)
        return
    peak = measured_peak()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  measured bf16 peak "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    results = {}
    for name in CONFIGS:
        if name.split("/")[0] not in args.workloads.split(",") or (args.configs and name not in args.configs.split(",")):
            continue
        cmd = [sys.executable, __file__, "--only", name] + (["--profile"] if args.profile else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not line:
            print(f"{name}: FAILED\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[name] = json.loads(line[-1][len("RESULT "):])
        print(f"{name}: {results[name]}", flush=True)
    g = GPT
    n_params = 12 * g["layers"] * g["hidden"] ** 2 + g["vocab"] * g["hidden"]
    gpt_flops = (6 * n_params + 12 * g["layers"] * g["seq"] * g["hidden"]) * g["batch"] * g["seq"]
    from lightning_megatron.transformer.flops import training_flops_per_sequence   # causal attention counted half

    llama_flops = training_flops_per_sequence(llama_config(), LLAMA["seq"], LLAMA["vocab"]) * LLAMA["batch"]
    print("\n| configuration | step ms | vs plain loop (same model) | vs plain whole-step graph | MFU (measured peak) "
          "| MFU (790) | peak GiB | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        workload = name.split("/")[0]
        plain, graph = results.get(f"{workload}/plain"), results.get(f"{workload}/plain-hf-graph")
        vs_plain = f"{r['step_s'] / plain['step_s']:.3f}x" if plain else "-"
        vs_graph = f"{r['step_s'] / graph['step_s']:.3f}x" if graph and workload == "bert" else "-"
        mfu = mfu790 = "-"
        flops = {"gpt": gpt_flops, "gpt8": gpt_flops * 2, "llama": llama_flops}.get(workload)
        if flops:
            mfu, mfu790 = f"{flops / r['step_s'] / peak:.1%}", f"{flops / r['step_s'] / NOMINAL_PEAK:.1%}"
        print(f"| {name} | {r['step_s'] * 1e3:.2f} | {vs_plain} | {vs_graph} | {mfu} | {mfu790} | "
              f"{r['peak_gib']:.1f} | {r['final_loss']:.4f} |")
    for name, r in results.items():
        if "profile" in r:
            shown = {k: v for k, v in r["profile"].items() if k != "kernels"}
            print(f"{name} per step: {shown}")
    for workload in ("gpt", "bert"):
        plain, ours = results.get(f"{workload}/plain", {}), results.get(f"{workload}/ours-eager", {})
        if "profile" in plain and "profile" in ours:
            print(f"{workload}: ours-eager minus plain, per kernel:")
            compare_profiles(plain["profile"], ours["profile"])


if __name__ == "__main__":
    main()
