"""Issue 31's hang detector on two GPUs (NCCL): rank 1 stalls in Python at step 5, or rank 0 joins an all-reduce
that rank 1 skips; with ``LIGHTNING_MEGATRON_HANG_TIMEOUT_S=20`` every rank prints one message naming where each
rank is (the stalled rank as the one that differs), and every process is gone within the timeout plus the exit
grace (2 s after a verdict) plus a margin, under Lightning's launcher and under torchrun, at TP2, PP2 and DP2."""

import pytest
import torch

from helpers.fault_runs import run_fault

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
HANG_TIMEOUT_S = 20


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
@pytest.mark.parametrize("fault", ["stall", "skip-collective"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_a_stuck_rank_is_named_and_every_rank_ends(tmp_path, layout, fault, launcher):
    output, returncode, gone_after = run_fault(tmp_path, layout, fault, launcher, 300, 120,
                                               LIGHTNING_MEGATRON_HANG_TIMEOUT_S=str(HANG_TIMEOUT_S))
    assert returncode != 0
    assert output.count("lightning_megatron: the run is stuck") >= 2, output[-4000:]   # one per rank
    assert "\n  rank 0: " in output and "\n  rank 1: " in output, output[-4000:]
    if fault == "stall":
        assert "rank 1 differs from the others" in output and "in on_train_batch_start" in output, output[-4000:]
    assert gone_after <= HANG_TIMEOUT_S + 2 + 12, f"{gone_after:.1f} s\n{output[-4000:]}"
    start = output.index("lightning_megatron: the run is stuck")
    print(f"{layout} {fault} {launcher}: every process gone {gone_after:.1f} s after the fault\n"
          f"{output[start:output.index(chr(10) + 'rank ', start)]}")
