"""Two switches on how a column-parallel linear's input-gradient reduce-scatter runs beside its weight-gradient GEMM
(``column_backward.py``), for measuring whether the two overlap at all (``benchmarks/bench_tp_overlap.py``; the
tenth session's TP2 profile has the kernels adding up to the step, as if they did not). Both off by default; the
numbers are those of the plain path either way (the copy-engine sum to float rounding).

- ``LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT=N``: cuBLAS leaves ``N`` SMs free during the weight-gradient GEMM
  (``torch._C._set_sm_carveout_experimental``), so NCCL's kernel is not kept waiting for SMs by the persistent GEMM.
- ``LIGHTNING_MEGATRON_TP_WGRAD_OVERLAP=copy_engine``: the reduce-scatter through PyTorch's symmetric memory in its
  low-contention form (``torch.ops.symm_mem._low_contention_reduce_scatter``: copy engines move the chunks, one small
  kernel sums them), on CUDA under sequence parallelism; ``nccl`` (the default) is NCCL's.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .comm_overlap import enable_symmetric_memory

CARVEOUT_ENV = "LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT"
OVERLAP_ENV = "LIGHTNING_MEGATRON_TP_WGRAD_OVERLAP"


def wgrad_sm_carveout() -> Optional[int]:
    """The SMs the overlapped weight-gradient GEMM leaves to the collective (``CARVEOUT_ENV``), or None; looked up at
    every column-parallel forward, its value checked once."""
    return _carveout(os.environ.get(CARVEOUT_ENV, "").strip())


@functools.lru_cache(maxsize=None)
def _carveout(value: str) -> Optional[int]:
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{CARVEOUT_ENV}={value!r}: give a whole number of SMs (e.g. 16) or leave it unset.")
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        raise ValueError(f"{CARVEOUT_ENV}={value!r}: this torch {torch.__version__} has no SM carve-out for cuBLAS "
                         f"(torch._C._set_sm_carveout_experimental); leave it unset.")
    return int(value) or None


@contextmanager
def sm_carveout(sms: Optional[int]) -> Iterator[None]:
    """cuBLAS leaves ``sms`` SMs free for the GEMMs inside (nothing when None)."""
    if sms is None:
        yield
        return
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def copy_engine_reduce_scatter() -> bool:
    """Whether ``OVERLAP_ENV`` asks for the copy-engine reduce-scatter (refused by name where this torch lacks it).
    Read at every column-parallel forward: the variable is looked up, its value checked once."""
    return _copy_engine(os.environ.get(OVERLAP_ENV, "").strip() or "nccl")


@functools.lru_cache(maxsize=None)
def _copy_engine(value: str) -> bool:
    if value not in ("nccl", "copy_engine"):
        raise ValueError(f"{OVERLAP_ENV}={value!r}: use 'nccl' (the default) or 'copy_engine'.")
    if value == "nccl":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem
        available = hasattr(symm_mem, "_low_contention_reduce_scatter")
    except ImportError:
        available = False
    if not available:
        raise ValueError(f"{OVERLAP_ENV}=copy_engine: this torch {torch.__version__} has no symmetric-memory "
                         f"low-contention reduce-scatter; leave it unset.")
    return True


def start_copy_engine_reduce_scatter(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of ``partial``'s first-dimension chunk of this rank, started on symmetric memory's
    stream: pass the result to ``torch.ops._c10d_functional.wait_tensor`` before reading it."""
    enable_symmetric_memory(group)
    out: torch.Tensor = torch.ops.symm_mem._low_contention_reduce_scatter(partial.contiguous(), "sum",
                                                                          group.group_name)
    return out
