"""Where the host time of a host-bound step goes: BERT-base (bf16-true, fused AdamW, clipping) through the
Trainer with our strategy vs Lightning "auto", each timed, then ours under cProfile.

    python benchmarks/profile_host.py [--steps 100] [--top 40]

Prints ms/step for both and the functions with the most own (tottime) and cumulative time in ours, per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(strategy_name: str, steps: int, profile: bool, top: int) -> None:
    import lightning as L
    import torch

    from bench_user_path import build_model, loader, loss_of, world_of_one

    warmup, marks = 20, {}

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = build_model("bert")

        def training_step(self, batch, batch_idx):
            loss = loss_of("bert", self.model, batch)
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
                    marks["prof"] = cProfile.Profile()
                    marks["prof"].enable()

        def on_train_end(self, trainer, module):
            if profile:
                marks["prof"].disable()
            torch.cuda.synchronize()
            marks["end"] = time.perf_counter()

    if strategy_name == "auto":
        world_of_one()
        strategy = "auto"
    else:
        from lightning_megatron import MegatronStrategy

        strategy = MegatronStrategy()
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-true", max_steps=warmup + steps,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Clock()])
    trainer.fit(Module(), loader("bert", warmup + steps))
    print(f"{strategy_name}{' (cProfile on)' if profile else ''}: {1000 * (marks['end'] - marks['start']) / steps:.2f} "
          "ms/step", flush=True)
    if profile:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(marks["prof"], stream=out).sort_stats(key).print_stats(top)
            print(f"--- by {key} (seconds over {steps} steps) ---")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.only:
        run(args.only, args.steps, args.profile, args.top)
        return
    for name, profile in (("auto", False), ("megatron", False), ("auto", False), ("megatron", False),
                          ("megatron", True)):
        cmd = [sys.executable, __file__, "--only", name, "--steps", str(args.steps), "--top", str(args.top)]
        subprocess.run(cmd + (["--profile"] if profile else []), check=True)


if __name__ == "__main__":
    main()
