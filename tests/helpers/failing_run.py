"""A two-GPU fit in which rank 1 fails at step 5 (``tests/gpu/test_failure_gpu.py`` runs it under Lightning's
launcher and under torchrun): ``python failing_run.py LAYOUT FAULT OUT_DIR`` with LAYOUT tp2 | pp2 | dp2 and FAULT
raise | exit | kill, or stall | skip-collective (``tests/gpu/test_hang_gpu.py``: rank 1 sleeps in Python; rank 0
joins an all-reduce on a group of both ranks that rank 1 skips). Every rank writes its pid to OUT_DIR/pid<rank>;
rank 1 writes the time of the fault to OUT_DIR/fault just before it."""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/, for helpers.*

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_megatron import MegatronStrategy  # noqa: E402
from helpers.strategy_utils import TinyGPT, TokenData  # noqa: E402

LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2, micro_batch_size=2),
           "dp2": dict()}


class FailAtStep5(L.Callback):
    def __init__(self, fault, out):
        self.fault, self.out, self.group = fault, out, None

    def on_train_start(self, trainer, module):
        if self.fault == "skip-collective":   # a group of both ranks, used by rank 0 alone
            self.group = dist.new_group([0, 1])
        with open(os.path.join(self.out, f"pid{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx != 5:
            return
        if trainer.global_rank == 0 and self.fault == "skip-collective":
            together = torch.ones(1, device=module.device)
            dist.all_reduce(together, group=self.group)
            together.item()   # NCCL: the host waits here for the peer that never comes
            return
        if trainer.global_rank != 1:
            return
        with open(os.path.join(self.out, "fault"), "w") as f:
            f.write(repr(time.time()))
        if self.fault == "stall":
            time.sleep(3600)
        if self.fault == "skip-collective":
            return
        if self.fault == "raise":
            raise RuntimeError("boom at step 5")
        if self.fault == "exit":
            sys.exit(1)
        os.kill(os.getpid(), signal.SIGKILL)


def main(layout, fault, out):
    trainer = L.Trainer(accelerator="gpu", devices=2, strategy=MegatronStrategy(**LAYOUTS[layout]), max_steps=10_000,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FailAtStep5(fault, out)])
    trainer.fit(TinyGPT(lr=0.01), DataLoader(TokenData(n=100_000), batch_size=8))


if __name__ == "__main__":
    main(*sys.argv[1:4])
