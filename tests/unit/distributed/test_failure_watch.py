"""A failed rank ends every rank within seconds and the others say which rank failed (``distributed/failure.py``),
on two processes over gloo with the watch asked for gloo too (the strategy watches NCCL runs): rank 1 reports
its error and then hangs as an NCCL rank's teardown does; rank 0 is stuck as a peer in a collective is."""

import os
import socket
import subprocess
import sys
import time

from helpers.paths import ROOT

SCRIPT = r"""
import os, sys, time
import torch.distributed as dist
from lightning_megatron.distributed.failure import FailureWatch

dist.init_process_group("gloo", init_method="env://")
watch = FailureWatch(poll_s=0.2, exit_after_s=float(os.environ["EXIT_AFTER"]), backends=("gloo",)).start()
print("ready", flush=True)
if dist.get_rank() == 1 and os.environ.get("FAIL") == "1":
    time.sleep(1.0)
    try:
        raise RuntimeError("boom at step 5")
    except RuntimeError as error:
        watch.report(error)
time.sleep(120)   # rank 1: a teardown that waits forever; rank 0: a collective its peer never joins
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(fail, exit_after=2.0, timeout=90):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   FAIL="1" if fail else "0", EXIT_AFTER=str(exit_after), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _wait_ready(procs):
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"


def test_a_failed_rank_ends_every_rank_and_is_named_by_the_others():
    procs = _launch(fail=True)
    try:
        _wait_ready(procs)
        failed_at = time.monotonic() + 1.0            # rank 1 reports one second after "ready"
        codes = [proc.wait(timeout=60) for proc in procs]
        ended_after = time.monotonic() - failed_at
    finally:
        for proc in procs:
            proc.kill()
    errors = [proc.stderr.read() for proc in procs]
    assert codes == [1, 1], errors
    assert ended_after < 8, ended_after               # exit_after 2 s: both gone well within the 15 s asked for
    assert "lightning_megatron: rank 1 failed: RuntimeError: boom at step 5; rank 0 stops" in errors[0], errors[0]
    assert errors[1].count("RuntimeError: boom at step 5") == 1, errors[1]   # rank 1's own traceback, once
    assert "Traceback" in errors[1]


def test_no_failure_no_exit_and_zero_turns_the_watch_off():
    for fail, exit_after in ((False, 2.0), (True, 0.0)):
        procs = _launch(fail=fail, exit_after=exit_after)
        try:
            _wait_ready(procs)
            time.sleep(5)                             # long past the failure and the 2 s grace
            assert [proc.poll() for proc in procs] == [None, None], (fail, exit_after)
        finally:
            for proc in procs:
                proc.kill()
