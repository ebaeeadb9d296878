"""Issue 31 on two GPUs (NCCL): an exception, ``sys.exit(1)`` or SIGKILL on rank 1 at step 5 ends every process
within 15 s, under Lightning's own launcher and under torchrun, at TP2, PP2 and DP2; the error is shown and, for an
exception, the other rank names the failed one."""

import pytest
import torch

from helpers.fault_runs import run_fault

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
@pytest.mark.parametrize("fault", ["raise", "exit", "kill"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_a_failing_rank_ends_every_rank(tmp_path, layout, fault, launcher):
    output, returncode, gone_after = run_fault(tmp_path, layout, fault, launcher, 240, 60)
    assert gone_after <= 15, f"{gone_after:.1f} s\n{output[-4000:]}"
    assert returncode != 0
    if fault == "raise":
        assert "RuntimeError: boom at step 5" in output, output[-4000:]
    named = "rank 1 failed: RuntimeError: boom at step 5; rank 0 stops" in output
    print(f"{layout} {fault} {launcher}: every process gone {gone_after:.1f} s after the fault"
          f"{'; rank 0 named rank 1' if named else ''}")
