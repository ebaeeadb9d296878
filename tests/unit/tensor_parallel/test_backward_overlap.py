"""``tensor_parallel/backward_overlap.py``'s switches, ``LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT`` and
``LIGHTNING_MEGATRON_TP_WGRAD_OVERLAP``: read and checked by name, and the carve-out is undone after the GEMM
whatever happens in it (on GPUs, where they act: tests/gpu/test_comm_overlap_gpu.py)."""

import pytest
import torch

from lightning_megatron.tensor_parallel import backward_overlap


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("0", None), ("16", 16), (" 8 ", 8)])
def test_the_carveout_is_read(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(backward_overlap.CARVEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(backward_overlap.CARVEOUT_ENV, value)
    assert backward_overlap.wgrad_sm_carveout() == expected


@pytest.mark.parametrize("value", ["sixteen", "-4", "1.5"])
def test_a_bad_carveout_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(backward_overlap.CARVEOUT_ENV, value)
    with pytest.raises(ValueError, match="LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT=.*whole number of SMs"):
        backward_overlap.wgrad_sm_carveout()


def test_the_carveout_is_undone_after_the_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", calls.append)
    with backward_overlap.sm_carveout(None):
        pass
    assert calls == []
    with pytest.raises(RuntimeError, match="in the GEMM"):
        with backward_overlap.sm_carveout(24):
            raise RuntimeError("in the GEMM")
    assert calls == [24, None]


def test_a_torch_without_the_carveout_is_told(monkeypatch):
    monkeypatch.setenv(backward_overlap.CARVEOUT_ENV, "16")
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental", raising=False)
    backward_overlap._carveout.cache_clear()   # each value is checked once per process
    try:
        with pytest.raises(ValueError, match="has no SM carve-out for cuBLAS"):
            backward_overlap.wgrad_sm_carveout()
    finally:
        backward_overlap._carveout.cache_clear()


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("nccl", False), ("copy_engine", True)])
def test_the_reduce_scatter_choice_is_read(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(backward_overlap.OVERLAP_ENV, raising=False)
    else:
        monkeypatch.setenv(backward_overlap.OVERLAP_ENV, value)
    assert backward_overlap.copy_engine_reduce_scatter() is expected


def test_a_bad_reduce_scatter_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(backward_overlap.OVERLAP_ENV, "nvshmem")
    with pytest.raises(ValueError, match="LIGHTNING_MEGATRON_TP_WGRAD_OVERLAP='nvshmem': use 'nccl'"):
        backward_overlap.copy_engine_reduce_scatter()
