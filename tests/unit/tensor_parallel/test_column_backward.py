"""``LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT`` (``tensor_parallel/column_backward.py``): read and checked by name,
and the carve-out is undone after the GEMM whatever happens in it (on GPUs: tests/gpu/test_comm_overlap_gpu.py)."""

import pytest
import torch

from lightning_megatron.tensor_parallel import column_backward


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("0", None), ("16", 16), (" 8 ", 8)])
def test_the_carveout_is_read(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(column_backward.CARVEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(column_backward.CARVEOUT_ENV, value)
    assert column_backward.wgrad_sm_carveout() == expected


@pytest.mark.parametrize("value", ["sixteen", "-4", "1.5"])
def test_a_bad_carveout_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(column_backward.CARVEOUT_ENV, value)
    with pytest.raises(ValueError, match="LIGHTNING_MEGATRON_TP_WGRAD_SM_CARVEOUT=.*whole number of SMs"):
        column_backward.wgrad_sm_carveout()


def test_the_carveout_is_undone_after_the_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", calls.append)
    with column_backward._sm_carveout(None):
        pass
    assert calls == []
    with pytest.raises(RuntimeError, match="in the GEMM"):
        with column_backward._sm_carveout(24):
            raise RuntimeError("in the GEMM")
    assert calls == [24, None]


def test_a_torch_without_the_carveout_is_told(monkeypatch):
    monkeypatch.setenv(column_backward.CARVEOUT_ENV, "16")
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental", raising=False)
    with pytest.raises(ValueError, match="has no SM carve-out for cuBLAS"):
        column_backward.wgrad_sm_carveout()
