"""Where the host time of a host-bound step goes: BERT-base (bf16-true, fused AdamW, clipping) through the
Trainer with our strategy vs Lightning "auto", each timed in its own process, then ours under cProfile
(``bench_user_path.run_lightning``, the path users take).

    python benchmarks/profile_host.py [--steps 100] [--top 40]

Prints ms/step for both and the functions with the most own (tottime) and cumulative time in ours.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(strategy_name: str, steps: int, profile: bool, top: int) -> None:
    from bench_user_path import run_lightning

    out = run_lightning("bert", strategy_name, cprofile=profile, steps=steps)
    print(f"{strategy_name}{' (cProfile on)' if profile else ''}: {1000 * out['step_s']:.2f} ms/step", flush=True)
    if profile:
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            out["cprofile"].stream = text
            out["cprofile"].sort_stats(key).print_stats(top)
            print(f"--- by {key} (seconds over {steps} steps) ---")
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip()), flush=True)


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
