"""The rotary frequencies go where the model goes (a compiled layer would otherwise copy them from the host at every
call) and stay float32 whatever the model is cast to."""

import torch

from lightning_megatron.transformer.rotary import RotaryEmbedding

LONGROPE = {"rope_type": "longrope", "factor": 2.0, "long_factor": [1.5] * 4, "short_factor": [1.0] * 4,
            "original_max_position_embeddings": 16}


def _holder():
    model = torch.nn.Linear(2, 2)
    model.rotary = RotaryEmbedding(8, scaling=LONGROPE)
    return model, model.rotary.inv_freq.clone(), model.rotary.long_inv_freq.clone()


def test_casting_the_model_keeps_the_frequencies_float32_and_exact():
    model, short, long = _holder()
    model.to(torch.bfloat16)
    model.half()
    assert model.weight.dtype == torch.float16
    assert model.rotary.inv_freq.dtype == model.rotary.long_inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, short) and torch.equal(model.rotary.long_inv_freq, long)


def test_the_frequencies_follow_a_device_move_and_keep_their_values_through_meta_and_to_empty():
    model, short, long = _holder()
    moved = []
    original = torch.Tensor.to

    def recording(tensor, *args, **kwargs):
        out = original(tensor, *args, **kwargs)
        if tensor.shape == short.shape and tensor.dtype == torch.float32:
            moved.append(out.device.type)
        return out

    torch.Tensor.to = recording
    try:
        model.to("cpu")
    finally:
        torch.Tensor.to = original
    assert moved.count("cpu") >= 2   # both tables were moved to where the model went
    model.to("meta")
    assert model.weight.is_meta and not model.rotary.inv_freq.is_meta   # values a meta tensor would lose
    model.to_empty(device="cpu")
    assert torch.equal(model.rotary.inv_freq, short) and torch.equal(model.rotary.long_inv_freq, long)


def test_a_model_built_under_a_device_context_has_its_frequencies_there():
    with torch.device("meta"):
        on_meta = RotaryEmbedding(8)
    assert not on_meta.inv_freq.is_meta   # meta would lose the values: they stay where they were made
    default = torch.get_default_device()
    moved = []
    original = RotaryEmbedding._move_frequencies

    def recording(self, device):
        moved.append(torch.device(device).type)
        return original(self, device)

    RotaryEmbedding._move_frequencies = recording
    try:
        RotaryEmbedding(8)
    finally:
        RotaryEmbedding._move_frequencies = original
    assert moved == [default.type]
