"""Background saves on a GPU (issue 31): the snapshot is the state at the save's point although training changes the
tensors right after, both when the state is copied into one GPU block first (the default where it fits) and when it
is copied straight into the pinned host slab on the current stream (no room for the block); the block is freed once
it landed; every dtype and layout lands exactly."""

import pytest
import torch

from lightning_megatron.checkpoint import stage as stage_module
from lightning_megatron.checkpoint.background import BackgroundSaver
from lightning_megatron.checkpoint.sharded import load_sharded

pytestmark = pytest.mark.gpu


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, optimizer


def train(model, optimizer, steps):
    for _ in range(steps):
        model(torch.randn(512, 1024, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("clones_fit", [True, False])
def test_a_background_save_holds_the_state_of_its_step(tmp_path, monkeypatch, clones_fit):
    landed_through_clones = []
    land_block = stage_module._land_block
    monkeypatch.setattr(stage_module, "_land_block",
                        lambda *a: landed_through_clones.append(1) or land_block(*a))
    monkeypatch.setattr(stage_module, "_clones_fit", lambda nbytes, device, peak=None: clones_fit)
    model, optimizer = model_and_optimizer()
    train(model, optimizer, 2)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected_moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    saver = BackgroundSaver()
    torch.cuda._sleep(200_000_000)   # the GPU is busy: the snapshot's copies queue behind this and the steps below
    saver.save(tmp_path / "ckpt", model, optimizer)
    train(model, optimizer, 3)       # queued right behind the snapshot: changes every tensor it holds
    for p in model.parameters():
        p.data.add_(1.0)
    saver.wait()
    assert bool(landed_through_clones) == clones_fit
    assert not torch.equal(model[0].weight, expected["0.weight"])

    fresh, fresh_optimizer = model_and_optimizer()
    train(fresh, fresh_optimizer, 1)   # optimizer state exists to load into
    load_sharded(tmp_path / "ckpt", fresh, fresh_optimizer)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    for p, moment in zip(fresh.parameters(), expected_moments):
        assert torch.equal(fresh_optimizer.state[p]["exp_avg"], moment)
    saver.close()


def test_clones_are_freed_once_written_and_refused_without_room(tmp_path):
    model, optimizer = model_and_optimizer()
    train(model, optimizer, 1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    saver = BackgroundSaver()
    saver.save(tmp_path / "ckpt", model, optimizer)
    saver.wait()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    free, total = torch.cuda.mem_get_info()
    assert not stage_module._clones_fit(total, torch.device("cuda"))
    assert stage_module._clones_fit(1 << 20, torch.device("cuda"))
    saver.close()


def test_reserve_warms_the_gpu_block_so_the_first_save_allocates_nothing_new(tmp_path):
    """``reserve`` fills a GPU block once and lets it go: the first save's block comes from the allocator's cache
    (reserved memory does not grow), nothing stays allocated, and the snapshot is still the save's state."""
    model, optimizer = model_and_optimizer()
    train(model, optimizer, 1)
    saver = BackgroundSaver()
    saver.reserve(model, optimizer)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert reserved - allocated >= saver._slab.layout.gpu_bytes   # the block's memory is kept, unused
    train(model, optimizer, 1)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    saver.save(tmp_path / "ckpt", model, optimizer)
    assert torch.cuda.memory_reserved() == reserved
    saver.wait()
    saver.close()
    fresh, _ = model_and_optimizer()
    load_sharded(tmp_path / "ckpt", fresh)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_every_dtype_and_layout_lands_exactly_in_the_pinned_slab():
    """bf16, float32, int64 and bool tensors, a transposed (strided) one and an empty one, through the GPU block and
    the one transfer to the pinned slab: each slab view equals its source; and again, changed in place, through the
    same copy plan (a later save reuses it: it must read the tensors, not copies made when it was planned)."""
    from lightning_megatron.checkpoint.entries import Entry
    from lightning_megatron.checkpoint.placement import Ranks, placement_of

    sources = {"bf16": torch.randn(1000, 37, device="cuda").to(torch.bfloat16),
               "strided": torch.randn(37, 1000, device="cuda").t(),
               "int64": torch.arange(7, device="cuda"), "bool": torch.rand(33, device="cuda") > 0.5,
               "empty": torch.empty(0, 5, device="cuda"), "step": torch.tensor(3.0)}
    entries = [Entry(key, placement_of(tensor, Ranks()), [tensor]) for key, tensor in sources.items()]
    slab = stage_module.slab_for(entries, None)
    assert slab.pinned and slab.bytes.is_pinned()
    plan = stage_module.plan_copies(entries, slab)
    for _ in range(2):
        snapshot = stage_module.to_host(entries, {}, slab, plan=plan)
        assert snapshot.cloned_bytes == slab.layout.gpu_bytes > 0
        snapshot.land()
        for key, source in sources.items():
            assert torch.equal(slab.view(key), source.cpu()), key
        for key, source in sources.items():
            if source.dtype == torch.bool:
                source.logical_not_()
            else:
                source.add_(1)
    slab.close()


def _background_then_resume(root):
    import os

    from helpers.strategy_utils import fit_saving_every_step

    background = fit_saving_every_step(os.path.join(root, "background"), 5, True, accelerator="gpu")
    resumed = fit_saving_every_step(os.path.join(root, "resumed"), 5, False,
                                    os.path.join(root, "background", "step=2.ckpt"), accelerator="gpu")
    return background, resumed


def test_background_saves_on_two_gpus_resume_exactly(tmp_path):
    """TP2 on two GPUs (NCCL for training, the writing processes' own gloo group for the saves), AdamW, dropout, a
    save every step in the background: every folder is complete and a run resumed from step 2's goes on exactly like the run that
    saved it."""
    from lightning_megatron.checkpoint import is_checkpoint
    from lightning_megatron.testing import run_on_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for background, resumed in run_on_ranks(_background_then_resume, 2, str(tmp_path), backend="nccl",
                                            init_process_group=False, timeout=600):
        assert len(background) == 5 and resumed == background[2:]
    assert all(is_checkpoint(tmp_path / "background" / f"step={step}.ckpt") for step in range(1, 6))
