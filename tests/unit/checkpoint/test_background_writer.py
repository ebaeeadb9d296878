"""The pieces of background saves below the strategy: the host slab's layout and views, the snapshot taken at the
save's point, and the writing process (its errors raised in the training process, its end with that process)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_megatron.checkpoint import writer_process
from lightning_megatron.checkpoint.background import BackgroundSaver
from lightning_megatron.checkpoint.entries import Entry
from lightning_megatron.checkpoint.errors import CheckpointError
from lightning_megatron.checkpoint.host_slab import ALIGN, HostSlab, layout_of
from lightning_megatron.checkpoint.placement import Ranks, placement_of
from lightning_megatron.checkpoint.sharded import load_sharded
from lightning_megatron.checkpoint.stage import slab_for, to_host
from helpers.fault_runs import alive


def _entries(tensors):
    return [Entry(key, placement_of(tensor, Ranks()), [tensor]) for key, tensor in tensors.items()]


def test_the_layout_aligns_every_tensor_and_matches_only_the_same_tensors():
    tensors = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2, 5), "c": torch.zeros(0),
               "d": torch.zeros(7, dtype=torch.int64)}
    layout = layout_of(_entries(tensors))
    offsets = sorted(slot.offset for slot in layout.slots.values())
    assert all(offset % ALIGN == 0 for offset in offsets) and len(set(offsets)) == 3   # the empty one shares
    assert layout.nbytes == 3 * ALIGN and layout.gpu_bytes == 0
    assert layout.matches(_entries(tensors))
    assert not layout.matches(_entries({**tensors, "b": torch.zeros(5, 2)}))
    assert not layout.matches(_entries({**tensors, "a": torch.zeros(3)}))
    assert not layout.matches(_entries({k: v for k, v in tensors.items() if k != "d"}))


def test_a_snapshot_holds_the_state_of_the_save_call_exactly():
    """Every dtype and a strided tensor land bit for bit in the slab at the call; changing them afterwards does not
    reach the snapshot; a slab is reused while the tensors keep their shapes, replaced when they change."""
    tensors = {"w": torch.randn(4, 6).t(), "h": torch.randn(9).to(torch.bfloat16), "n": torch.arange(5),
               "m": torch.rand(11) > 0.5}
    expected = {key: tensor.clone() for key, tensor in tensors.items()}
    slab = slab_for(_entries(tensors), None)
    snapshot = to_host(_entries(tensors), {"extra": {"step": 3}}, slab)
    for tensor in tensors.values():
        tensor.zero_()
    snapshot.land()
    for entry in snapshot.entries:
        assert torch.equal(entry.local, expected[entry.key]), entry.key
        assert entry.local.data_ptr() == slab.view(entry.key).data_ptr()
    assert torch.load(__import__("io").BytesIO(snapshot.pickled["extra"])) == {"step": 3}
    assert slab_for(_entries(tensors), slab) is slab
    bigger = slab_for(_entries({**tensors, "w": torch.zeros(7, 7)}), slab)
    assert bigger is not slab and slab.bytes is None   # the old one was closed
    bigger.close()


def test_the_writer_process_maps_the_slab_and_writes_what_the_call_saw(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    saver = BackgroundSaver()
    saver.reserve(model, optimizer)
    saver.save(tmp_path / "ckpt", model, optimizer, extra_state={"epoch": 2})
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    saver.wait()
    writer = saver._writer
    assert writer is not None and writer.process.poll() is None and writer.process.pid != os.getpid()
    saver.close()
    assert writer.process.poll() == 0   # told to end, it ended cleanly
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    assert load_sharded(tmp_path / "ckpt", fresh) == {"epoch": 2}
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def fail_every_write():
    """Run in the writing process: every shard write fails."""
    import torch.distributed.checkpoint as dcp

    def write_data(writer, plan, planner):
        raise OSError("disk full (simulated)")
    dcp.FileSystemWriter.write_data = write_data


def test_an_error_in_the_writer_process_is_raised_by_the_next_wait_with_its_text(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_process, "CHILD_SETUP", fail_every_write)
    model = torch.nn.Linear(4, 4)
    saver = BackgroundSaver()
    saver.save(tmp_path / "ckpt", model)
    with pytest.raises(CheckpointError, match="background save of .*ckpt failed .*disk full"):
        saver.wait()
    assert not (tmp_path / "ckpt").exists()
    saver.close()


def test_the_writer_process_ends_when_its_training_process_dies(tmp_path):
    """A training process killed (here: ``os._exit`` right after its first save started) leaves no writer behind."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        from lightning_megatron.checkpoint.background import BackgroundSaver
        saver = BackgroundSaver()
        saver.save({str(tmp_path / "ckpt")!r}, torch.nn.Linear(4, 4))
        print(saver._writer.process.pid, flush=True)
        os._exit(9)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while alive(pid):
        assert time.monotonic() < deadline, "the writing process outlived its training process"
        time.sleep(0.1)


def test_a_slab_closed_while_a_view_lives_is_released_with_the_view():
    slab = HostSlab(layout_of(_entries({"x": torch.zeros(4)})))
    view = slab.view("x")
    slab.close()
    assert slab.bytes is None and view.sum().item() == 0
