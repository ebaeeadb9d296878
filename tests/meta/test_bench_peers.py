"""The peer benchmark (issue #32) runs only on lent GPU machines, so its machinery is dry-run here on the CPU (tiny
shape, gloo): a broken script would otherwise waste that machine's time. Ours at two data-parallel ranks runs the
distributed optimizer with overlapped reduce-scatter and parameter gathers. At ``--tp 2`` the table's ratios divide
the tensor-parallel peer (``peer-tp-compiled``), not the DDP one; a ``-graphs`` name runs per-block CUDA graphs (the
eager capture backend here) with float8 (emulated); the tensor-parallel peer (DTensor, torchtitan's plan) runs too."""

import os
import subprocess
import sys

import pytest

from helpers.paths import ROOT


@pytest.mark.parametrize("gpus,tp,configs", [(1, 1, "ours,peer"), (2, 1, "ours"),
                                             (2, 2, "ours-fp8-graphs,ours-fp8-graphs-unsplit,ours-qkvapart,peer-tp")])
def test_peer_benchmark_dry_run_on_cpu(gpus, tp, configs):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--tiny",
                           "--accelerator", "cpu", "--gpus", str(gpus), "--tp", str(tp), "--configs", configs,
                           "--warmup", "2", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in configs.split(","):
        row = next((line for line in done.stdout.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, done.stdout[-3000:]
        assert float(row.split("|")[2]) > 0, row   # a measured step time, not a failed run's placeholder
    baseline = "peer-tp-compiled" if tp > 1 else "peer-compiled"
    assert f"| speed vs {baseline} |" in done.stdout, done.stdout[-3000:]


def test_an_unknown_configuration_is_refused_before_anything_runs():
    """A typo (``-graph`` for ``-graphs``) would otherwise measure another configuration than the one named."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--tiny",
                           "--accelerator", "cpu", "--configs", "ours,ours-compiled-fp8-graph"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and "unknown words: graph" in done.stderr, done.stderr[-2000:]
    assert "ms/step" not in done.stdout
