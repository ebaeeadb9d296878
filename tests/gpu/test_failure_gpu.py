"""Issue 31 on two GPUs (NCCL): an exception, ``sys.exit(1)`` or SIGKILL on rank 1 at step 5 ends every process
within 15 s, under Lightning's own launcher and under torchrun, at TP2, PP2 and DP2; the error is shown and, for an
exception, the other rank names the failed one."""

import os
import subprocess
import sys
import time

import pytest
import torch

from helpers.paths import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
SCRIPT = os.path.join(ROOT, "tests", "helpers", "failing_run.py")


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
@pytest.mark.parametrize("fault", ["raise", "exit", "kill"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_a_failing_rank_ends_every_rank(tmp_path, layout, fault, launcher):
    command = [sys.executable, SCRIPT, layout, fault, str(tmp_path)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + command[1:]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.path.join(ROOT, 'tests')}")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"still running after 240 s:\n{output[-4000:]}")
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    while any(_alive(pid) for pid in pids) and time.time() < float((tmp_path / "fault").read_text()) + 60:
        time.sleep(0.2)
    gone_after = time.time() - float((tmp_path / "fault").read_text())
    assert not any(_alive(pid) for pid in pids), output[-4000:]
    assert gone_after <= 15, f"{gone_after:.1f} s\n{output[-4000:]}"
    assert proc.returncode != 0
    if fault == "raise":
        assert "RuntimeError: boom at step 5" in output, output[-4000:]
    named = "rank 1 failed: RuntimeError: boom at step 5; rank 0 stops" in output
    print(f"{layout} {fault} {launcher}: every process gone {gone_after:.1f} s after the fault"
          f"{'; rank 0 named rank 1' if named else ''}")
