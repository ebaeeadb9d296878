"""Issue 31's hang detector on two GPUs (NCCL): rank 1 stalls in Python at step 5, or rank 0 joins an all-reduce
that rank 1 skips; with ``LIGHTNING_MEGATRON_HANG_TIMEOUT_S=20`` every rank prints one message naming where each
rank is (the stalled rank as the one that differs), and every process is gone within the timeout plus the exit
grace (2 s after a verdict) plus a margin, under Lightning's launcher and under torchrun, at TP2, PP2 and DP2."""

import os
import subprocess
import sys
import time

import pytest
import torch

from helpers.paths import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
SCRIPT = os.path.join(ROOT, "tests", "helpers", "failing_run.py")
HANG_TIMEOUT_S = 20


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
@pytest.mark.parametrize("fault", ["stall", "skip-collective"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_a_stuck_rank_is_named_and_every_rank_ends(tmp_path, layout, fault, launcher):
    command = [sys.executable, SCRIPT, layout, fault, str(tmp_path)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + command[1:]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.path.join(ROOT, 'tests')}",
               LIGHTNING_MEGATRON_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S))
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"still running after 300 s:\n{output[-4000:]}")
    fault_at = float((tmp_path / "fault").read_text())
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    while any(_alive(pid) for pid in pids) and time.time() < fault_at + 120:
        time.sleep(0.2)
    gone_after = time.time() - fault_at
    assert not any(_alive(pid) for pid in pids), output[-4000:]
    assert proc.returncode != 0
    assert output.count("lightning_megatron: the run is stuck") >= 2, output[-4000:]   # one per rank
    assert "\n  rank 0: " in output and "\n  rank 1: " in output, output[-4000:]
    if fault == "stall":
        assert "rank 1 differs from the others" in output and "in on_train_batch_start" in output, output[-4000:]
    assert gone_after <= HANG_TIMEOUT_S + 2 + 12, f"{gone_after:.1f} s\n{output[-4000:]}"
    start = output.index("lightning_megatron: the run is stuck")
    print(f"{layout} {fault} {launcher}: every process gone {gone_after:.1f} s after the fault\n"
          f"{output[start:output.index(chr(10) + 'rank ', start)]}")
