"""What a checkpoint save costs the training step it overlaps (issue #31): GPT-1.3B through
``Trainer(strategy=MegatronStrategy())`` on one GPU, its whole training state (bf16-true parameters and AdamW's
two moments, or with ``--precision bf16-mixed`` float32 parameters too), saved at one step by
``trainer.save_checkpoint`` in the foreground (no plugin) and in the background (``plugins=[AsyncCheckpointIO()]``).

Each step's time is the wall time between the ends of consecutive steps, each a synchronize of the training's
stream (``--sync device``: of the whole device, which also waits for the writing thread's copies); the save is
called at the end of the steps ``--save-at`` (the first save allocates the pinned host buffers, later ones
reuse them) (after its clock mark), so the step after it carries the save's
foreground part (staging to host memory) and overlaps the writing thread. Reported: the median normal step, the
steps around the save as multiples of it, and how long the whole save took to commit.

    python benchmarks/bench_background_save.py [--layers 24 --hidden 2048] [--dir /tmp/ckpt]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import threading
import time

import torch

from isolated import print_result, run_isolated   # benchmarks/isolated.py
from timing import cuda_api_by_thread, gpu_kernels, idle_gaps   # benchmarks/timing.py


def run_one(mode: str, args: argparse.Namespace) -> dict:
    import lightning as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.checkpoint.background import BackgroundSaver
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    if args.switch_interval is not None:   # how long a thread may keep the GIL while another waits for it
        sys.setswitchinterval(args.switch_interval)
    marks: list = []
    # the training stream's work (what the step waits for), or every stream's (the writer's copies too)
    sync = torch.cuda.current_stream().synchronize if args.sync == "stream" else torch.cuda.synchronize
    save_at = [int(step) for step in args.save_at.split(",")]
    saved: dict = {}
    folder = os.path.join(args.dir, mode)
    shutil.rmtree(folder, ignore_errors=True)

    class Module(L.LightningModule):
        def configure_model(self) -> None:
            if hasattr(self, "model"):
                return
            config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                                       num_attention_heads=args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                       activation="gelu_tanh")
            self.model = GPTModel(config, args.vocab, max_sequence_length=args.seq)

        def training_step(self, batch, batch_idx):
            return self.model(batch[0], labels=batch[1]).float().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    stalls: list = []   # per save: the main thread's waits for the GIL (a 1 ms sleeper's late wake-ups), ms
    sampling = threading.Event()

    def sample_gil() -> None:
        """Wake every millisecond while a save is young; a late wake-up means another thread held the GIL."""
        while True:
            sampling.wait()
            before = time.perf_counter()
            time.sleep(0.001)
            late = (time.perf_counter() - before) * 1e3 - 1
            if late > 5 and sampling.is_set():
                stalls[-1].append(round(late, 1))

    threading.Thread(target=sample_gil, daemon=True).start()
    in_call: list = []   # per save call: the seconds it waited for the write before it (a save waits for the last)
    plain_wait = BackgroundSaver.wait

    def timed_wait(saver) -> None:
        began = time.perf_counter()
        try:
            plain_wait(saver)
        finally:
            if in_call and in_call[-1] is None:
                in_call[-1] = round(time.perf_counter() - began, 3)

    BackgroundSaver.wait = timed_wait
    parts: list = []   # per save call: milliseconds in each part of it (--parts)

    def time_part(owner, name: str, label: str) -> None:
        plain = getattr(owner, name)

        def timed(*a, **k):
            began = time.perf_counter()
            try:
                return plain(*a, **k)
            finally:
                if parts:
                    parts[-1][label] = round(parts[-1].get(label, 0.0) + (time.perf_counter() - began) * 1e3, 2)
        setattr(owner, name, timed)

    if args.parts:
        from lightning_megatron.checkpoint import background, folder as ckpt_folder, sharded, stage, tensor_cache
        for owner, name in [(tensor_cache, "fingerprint"), (sharded, "collect_objects"), (background, "to_host"),
                            (stage, "_clones_fit"), (stage, "_fill_block"), (sharded, "agree"),
                            (ckpt_folder, "begin"), (background, "rendezvous"), (background, "job_of")]:
            time_part(owner, name, f"{owner.__name__.rsplit('.', 1)[-1]}.{name}")
    tracing: list = []   # the profiler running from the last save call to 3 steps later (--trace-out)

    def write_trace(prof, step_marks) -> None:
        """The last save's 3 steps under the profiler: each thread's CUDA calls, the GPU's idle gaps, the copies."""
        prof.stop()
        steps = [round((b - a) * 1e3, 1) for a, b in zip(step_marks, step_marks[1:])]
        copies = [(name, round((stop - begin) / 1e3, 2)) for name, begin, stop in gpu_kernels(prof)
                  if "memcpy" in name.lower()]
        with open(f"{args.trace_out}.{mode}", "w") as out:
            json.dump({"steps_ms (profiled)": steps, "cuda_api_by_thread": cuda_api_by_thread(prof),
                       "main_thread": threading.get_ident(), **idle_gaps(prof, 3),
                       "copies": {"count": len(copies), "ms": round(sum(ms for _, ms in copies), 1),
                                  "longest": sorted(copies, key=lambda c: -c[1])[:5]}}, out, indent=1, default=str)

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            sync()
            marks.append(time.perf_counter())
            if any(batch_idx == at + 3 for at in save_at):
                sampling.clear()
            if tracing and batch_idx == save_at[-1] + 3:
                write_trace(tracing.pop(), marks[-4:])
            if mode != "none" and batch_idx in save_at:
                stalls.append([])
                sampling.set()
                if args.trace_out and batch_idx == save_at[-1]:
                    tracing.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                      torch.profiler.ProfilerActivity.CUDA]))
                    tracing[-1].start()
                in_call.append(None)
                if args.parts and not parts:   # Lightning's own parts of the call, timed on the trainer's objects
                    time_part(trainer._checkpoint_connector, "dump_checkpoint", "lightning.dump_checkpoint")
                    time_part(trainer.strategy, "broadcast", "strategy.broadcast")
                parts.append({})
                start = time.perf_counter()
                profiler = cProfile.Profile() if args.profile_out else None
                with profiler or contextlib.nullcontext():
                    trainer.save_checkpoint(os.path.join(folder, f"step{batch_idx}.ckpt"))
                saved.setdefault("call_s", []).append(round(time.perf_counter() - start, 3))
                saved.setdefault("waited_s", []).append(in_call[-1] or 0.0)
                in_call[-1] = 0.0
                if profiler is not None:   # where the save call's time goes, each save after the other
                    with open(f"{args.profile_out}.{mode}", "a") as out:
                        out.write(f"== save at step {batch_idx}: {saved['call_s'][-1]} s\n")
                        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
                saved["started"] = start

        def on_train_end(self, trainer, module):
            if "started" in saved:
                writer = getattr(trainer.strategy, "_background", None)
                if writer is not None:   # the background write must have committed
                    writer.wait()
                saved["commit_s"] = time.perf_counter() - saved["started"]

    steps = save_at[-1] + 1 + args.after
    ids = torch.randint(0, args.vocab, (args.batch * steps, args.seq))
    data = torch.utils.data.TensorDataset(ids, ids.roll(-1, 1))
    plugins = [AsyncCheckpointIO()] if mode == "background" else []
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MegatronStrategy(), precision=args.precision,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock()], plugins=plugins)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=args.batch))
    state_gib = sum(t.numel() * t.element_size() for t in trainer.lightning_module.parameters()) / 2**30
    times = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]   # times[i]: step i + 1
    normal = statistics.median(times[2:save_at[0]])
    after = [times[at:at + 3] for at in save_at]   # the three steps after each save call
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files) \
        if os.path.isdir(folder) else 0
    return {"gil_stalls_ms": [{"total": round(sum(x), 1), "count": len(x), "largest": sorted(x)[-5:]} for x in stalls],
            "normal_ms": normal, "after_ms": after, "call_s": saved.get("call_s"), "waited_s": saved.get("waited_s"),
            "commit_s": saved.get("commit_s"), "call_parts_ms": parts,
            "params_gib": state_gib, "written_gib": size / 2**30 / len(save_at),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--save-at", default="8,150", help="steps at whose end a save is called (the first one "
                        "allocates the host buffers; later ones reuse them)")
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/bench_background_save")
    parser.add_argument("--modes", default="none,foreground,background")
    parser.add_argument("--sync", choices=("stream", "device"), default="stream",
                        help="step ends: the training stream's synchronize, or the whole device's (which also waits "
                             "for the writing thread's copies, as a loop calling torch.cuda.synchronize would)")
    parser.add_argument("--profile-out", default=None, help="cProfile each save call, appending the top functions "
                        "to this path + '.<mode>'")
    parser.add_argument("--trace-out", default=None, help="profile the last save's call and the 3 steps after it "
                        "(CUDA calls per thread, GPU idle gaps, copies) into this path + '.<mode>' (JSON)")
    parser.add_argument("--parts", action="store_true", help="time the parts of each save call (ms)")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval in each run")
    parser.add_argument("--only")
    args = parser.parse_args()
    if args.only:
        print_result(run_one(args.only, args))
        return
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  GPT {args.layers}x{args.hidden}  "
          f"{args.precision}  batch {args.batch}x{args.seq}", flush=True)
    for mode in args.modes.split(","):
        r = run_isolated(mode, [sys.executable, os.path.abspath(__file__), "--only", mode]
                         + [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
                              if k not in ("only", "modes") and v is not None and v is not False])
        if r is None:
            continue
        ratios = "; ".join(", ".join(f"{t / r['normal_ms']:.2f}x" for t in after) for after in r["after_ms"])
        print(f"{mode}: normal step {r['normal_ms']:.1f} ms; the 3 steps after each save call: {ratios}; save calls "
              f"{r['call_s']} s (of which waiting for the write before: {r['waited_s']} s), the last committed {r['commit_s']} s after its call; parameters "
              f"{r['params_gib']:.2f} GiB, written "
              f"{r['written_gib']:.2f} GiB per save; peak {r['peak_gib']:.1f} GiB; GIL waits over 5 ms from each save "
              f"call to 3 steps later: {r['gil_stalls_ms']}", flush=True)
        if r.get("call_parts_ms"):
            print(f"{mode}: parts of each save call (ms): {r['call_parts_ms']}", flush=True)


if __name__ == "__main__":
    main()
