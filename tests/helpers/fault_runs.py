"""Run ``tests/helpers/failing_run.py`` on two GPUs under Lightning's launcher or torchrun and time how long its
processes outlive the fault it plants (the GPU failure and hang tests)."""

import os
import subprocess
import sys
import time

import pytest

from helpers.paths import ROOT

SCRIPT = os.path.join(ROOT, "tests", "helpers", "failing_run.py")


def alive(pid):
    """Whether ``pid`` still runs (a zombie of ours counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def run_fault(tmp_path, layout, fault, launcher, timeout_s, wait_s, **env):
    """The run's output, exit status, and seconds from the fault until both rank processes were gone (waiting up to
    ``wait_s`` after the fault)."""
    command = [sys.executable, SCRIPT, layout, fault, str(tmp_path)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + command[1:]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.path.join(ROOT, 'tests')}", **env)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"still running after {timeout_s} s:\n{output[-4000:]}")
    fault_at = float((tmp_path / "fault").read_text())
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    while any(alive(pid) for pid in pids) and time.time() < fault_at + wait_s:
        time.sleep(0.2)
    gone_after = time.time() - fault_at
    assert not any(alive(pid) for pid in pids), output[-4000:]
    return output, proc.returncode, gone_after
