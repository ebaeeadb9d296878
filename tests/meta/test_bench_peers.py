"""The peer benchmark (issue #32) runs only on lent GPU machines, so its machinery is dry-run here on the CPU (tiny
shape, gloo): a broken script would otherwise waste that machine's time. Ours at two data-parallel ranks runs the
distributed optimizer with overlapped reduce-scatter and parameter gathers."""

import os
import subprocess
import sys

import pytest

from helpers.paths import ROOT


@pytest.mark.parametrize("gpus,configs", [(1, "ours,peer"), (2, "ours")])
def test_peer_benchmark_dry_run_on_cpu(gpus, configs):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--tiny",
                           "--accelerator", "cpu", "--gpus", str(gpus), "--configs", configs],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in configs.split(","):
        row = next((line for line in done.stdout.splitlines() if line.startswith(f"| {name} |")), None)
        assert row is not None, done.stdout[-3000:]
        assert float(row.split("|")[2]) > 0, row   # a measured step time, not a failed run's placeholder
