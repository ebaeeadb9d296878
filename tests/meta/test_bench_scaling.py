"""The multi-GPU scaling benchmark (issue #21) runs whenever a multi-GPU machine is lent, so its machinery
is dry-run here on CPU (gloo, tiny model): a broken script would otherwise waste that machine's time."""

import json
import os
import subprocess
import sys

from helpers.paths import ROOT


def test_scaling_benchmark_dry_run_on_cpu(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scaling.py"), "--gpus", "2",
                           "--tiny", "--accelerator", "cpu", "--only", "gpt-1gpu,gpt-pp2-vpp2-m4",
                           "--timeout", "240", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"gpt-1gpu", "gpt-pp2-vpp2-m4"} and None not in results.values(), done.stdout
    one, pipeline = results["gpt-1gpu"], results["gpt-pp2-vpp2-m4"]
    assert pipeline["layout"]["pp"] == 2 and pipeline["layout"]["vpp"] == 2
    assert one["step_s"] > 0 and pipeline["step_s"] > 0
    # the same 8 sequences a step in both layouts (2 x 4 on one process, 4 x 2 through the pipeline), float32
    assert abs(one["final_loss"] - pipeline["final_loss"]) < 1e-4, (one["final_loss"], pipeline["final_loss"])
    assert "| gpt-pp2-vpp2-m4 | 4 |" in done.stdout
    # a call cut short keeps its results: the tables print again from the file alone
    again = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scaling.py"), "--tiny",
                            "--tables-from", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "| gpt-pp2-vpp2-m4 | 4 |" in again.stdout, again.stderr[-2000:]


def test_moe_echo_and_skew_layouts_dry_run_on_cpu(tmp_path):
    """The ECHO rows the 4-GPU machine is for: the skew takes effect (routing, hence the loss, changes) and ECHO
    does not change the numbers (the same loss with spare slots), and the table compares ECHO with off."""
    out = tmp_path / "results.json"
    names = "moe-ep2,moe-ep2-skew,moe-ep2-skew-echo"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scaling.py"), "--gpus", "2",
                           "--tiny", "--accelerator", "cpu", "--only", names, "--timeout", "240", "--json", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(names.split(",")) and None not in results.values(), done.stdout
    balanced, skewed, echo = (results[n]["final_loss"] for n in names.split(","))
    assert results["moe-ep2-skew-echo"]["layout"]["spare"] == 1 and results["moe-ep2-skew"]["layout"]["skew"] > 0
    assert abs(skewed - balanced) > 1e-5, (skewed, balanced)
    assert abs(echo - skewed) < 1e-4, (echo, skewed)
    row = next(line for line in done.stdout.splitlines() if line.startswith("| moe-ep2-skew-echo |"))
    assert row.rstrip(" |").endswith("x"), row   # the ECHO-vs-off ratio
    # what ECHO decided, counted: every MoE layer forward planned or not (tiny: 2 MoE layers, 8 steps and more)
    decisions = results["moe-ep2-skew-echo"]["echo_forwards"]
    assert decisions["planned"] + decisions["unplanned"] >= 2 * 8, decisions
    assert decisions["planned"] >= 2, decisions   # the first step plans (nothing observed before it)
    assert len(decisions["busiest_over_mean"]) == decisions["unplanned"], decisions
    assert "ECHO in moe-ep2-skew-echo (MoE layer forwards" in done.stdout, done.stdout[-2000:]
    assert "echo_forwards" not in results["moe-ep2-skew"], results["moe-ep2-skew"]
