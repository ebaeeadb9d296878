"""Background saves on a GPU (issue 31): the snapshot is the state at the save's point although training changes the
tensors right after, both when the state is cloned on the GPU (the default where it fits) and when it is copied
straight to host memory on the current stream (no room for clones); the clones are freed once they landed."""

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
    land_clones = stage_module._land_clones
    monkeypatch.setattr(stage_module, "_land_clones",
                        lambda *a: landed_through_clones.append(1) or land_clones(*a))
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


@pytest.mark.parametrize("shape, contiguous", [((1000, 37), True), ((37, 1000), False), ((5,), True)])
def test_the_clones_land_in_slices_exactly(monkeypatch, shape, contiguous):
    """The writing thread's slice-by-slice copy (a slice far smaller than the tensor here) gives the whole tensor,
    strided ones too."""
    monkeypatch.setattr(stage_module, "LAND_CHUNK_BYTES", 4096)
    source = torch.randn(*shape, device="cuda").to(torch.bfloat16)
    if not contiguous:
        source = source.t()
    target = torch.empty_like(source, device="cpu", pin_memory=True)
    stage_module._copy_in_slices(target, source, torch.cuda.Stream())
    assert torch.equal(target, source.cpu())
