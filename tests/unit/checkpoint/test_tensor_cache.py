"""Background saves reuse the last save's entries only while the same tensors back them (``tensor_cache.py``):
training in place keeps them; anything swapped, added, reshaped or re-created is collected again, so a save never
writes a tensor the model no longer has."""

import copy

import pytest
import torch

from lightning_megatron.checkpoint.background import BackgroundSaver
from lightning_megatron.checkpoint.sharded import collect_tensors, load_sharded
from lightning_megatron.checkpoint.tensor_cache import TensorCollector


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.second(self.first(x)) * self.scale


def _trained():
    torch.manual_seed(0)
    model = _Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)
    return model, optimizer


def _step(model, optimizer):
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _contents(entries):
    return {entry.key: (entry.local.data_ptr(), tuple(entry.local.shape), entry.local.clone()) for entry in entries}


def test_training_in_place_reuses_the_entries_and_they_read_the_current_values():
    model, optimizer = _trained()
    collect = TensorCollector()
    entries, _ = collect(model, optimizer)
    _step(model, optimizer)
    again, _ = collect(model, optimizer)
    assert again is entries
    fresh, _ = collect_tensors(model, optimizer)
    assert [e.key for e in fresh] == [e.key for e in entries]
    for cached, new in zip(entries, fresh):
        assert torch.equal(cached.local, new.local) and cached.local.data_ptr() == new.local.data_ptr(), new.key


def _swap_data(model, optimizer):
    model.first.weight.data = model.first.weight.data.clone() + 1


def _reshape_data(model, optimizer):
    model.second.bias.data = torch.zeros(1, 3)


def _retype_data(model, optimizer):
    model.second.bias.data = model.second.bias.data.double()


def _transpose_data(model, optimizer):
    model.second.weight.data = model.second.weight.data.t().contiguous().t()   # same shape, other strides


def _new_buffer(model, optimizer):
    model.scale = torch.full((3,), 2.0)


def _new_module(model, optimizer):
    model.third = torch.nn.Linear(2, 2)   # parameters the optimizer does not update are saved too


def _new_state_tensor(model, optimizer):
    optimizer.state[model.first.weight]["exp_avg"] = torch.zeros_like(model.first.weight)


def _new_state_key(model, optimizer):
    optimizer.state[model.first.weight]["extra"] = torch.zeros(2)


def _new_param_group(model, optimizer):
    extra = torch.nn.Parameter(torch.zeros(2))
    model.extra = extra
    optimizer.add_param_group({"params": [extra]})


def _reloaded_optimizer(model, optimizer):
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))   # the state re-created as new tensors


@pytest.mark.parametrize("change", [_swap_data, _reshape_data, _retype_data, _transpose_data, _new_buffer,
                                    _new_module, _new_state_tensor, _new_state_key, _new_param_group,
                                    _reloaded_optimizer])
def test_any_tensor_swapped_added_reshaped_or_recreated_is_collected_again(change):
    model, optimizer = _trained()
    collect = TensorCollector()
    entries, _ = collect(model, optimizer)
    change(model, optimizer)
    again, _ = collect(model, optimizer)
    assert again is not entries
    expected = _contents(collect_tensors(model, optimizer)[0])
    got = _contents(again)
    assert got.keys() == expected.keys()
    for key, (pointer, shape, value) in expected.items():
        assert got[key][:2] == (pointer, shape) and torch.equal(got[key][2], value), key


def test_a_background_save_after_param_data_was_swapped_writes_the_new_tensor(tmp_path):
    """The swap ``param.data = ...`` keeps the parameter object: a cache keyed on it alone would write the old
    storage, which its cached entry still holds."""
    model, optimizer = _trained()
    saver = BackgroundSaver()
    saver.reserve(model, optimizer)
    saver.save(tmp_path / "one", model, optimizer)
    saver.wait()
    model.first.weight.data = torch.full_like(model.first.weight, 7.0)
    _step(model, optimizer)
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    saver.save(tmp_path / "two", model, optimizer)
    saver.close()
    fresh = _Model()
    load_sharded(tmp_path / "two", fresh)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
