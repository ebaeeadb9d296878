"""The TP-overlap micro-benchmark runs only on lent GPU machines; its plumbing is dry-run here (two gloo processes,
tiny shapes) so that a broken script does not waste that machine's time."""

import json
import os
import subprocess
import sys

from helpers.paths import ROOT


def test_tp_overlap_benchmark_dry_run_on_cpu():
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "benchmarks", "bench_tp_overlap.py"), "--cpu", "--tokens", "64",
                           "--hidden", "32", "--ffn", "64", "--iters", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["case"] for row in rows] == ["dgrad", "wgrad", "rs", "ag", "serial", "overlap", "ag+wgrad"], done.stdout
    assert all(row["ms"] > 0 for row in rows), rows
