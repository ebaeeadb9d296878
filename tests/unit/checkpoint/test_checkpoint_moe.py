"""Expert shards map to global expert indices: an EP=2 checkpoint loads at EP=1 (with and without ETP=2)."""

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.checkpoint import load_sharded, save_sharded
from lightning_megatron.moe import MoEConfig, MoELayer
from lightning_megatron.testing import run_on_ranks
from helpers.checkpoint_utils import activate, assert_same
from helpers.tp_utils import full_tensor

S, B, H = 4, 2, 8


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, topk=2, activation="swiglu",
                                      shared_expert_ffn_hidden_size=8, enable_expert_bias=True))

    def forward(self, x):
        return self.moe(x)


_full = full_tensor


def _view(model, optimizer, state):
    out = {name: b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias")}
    for name, param in model.named_parameters():
        out[name] = _full(param, param, state).clone()
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{name}/{key}"] = (_full(value, param, state) if value.shape == param.shape else value).clone()
    return out


def _ep2_to_ep1(path):
    state = activate(ep=2)
    torch.manual_seed(0)                          # replicated init: the same on every rank
    model = TinyMoE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    for param in model.parameters():             # the strategy's finalize: replicas stay identical
        if not getattr(param, "expert_parallel", False):
            dist.all_reduce(param.grad)
    optimizer.step()
    model.moe.router.expert_bias.copy_(torch.tensor([0.1, -0.1, 0.2, 0.0]))   # a persistent buffer
    saved, out = _view(model, optimizer, state), model(x).detach()
    save_sharded(path, model, optimizer)
    assert saved["moe.experts.weight1"].shape[0] == 4
    for layout in (dict(tp=2), dict(tp=1)):      # tp=2: experts split over etp=2 (weight1 with stride 2)
        state = activate(**layout)
        torch.manual_seed(5)
        model = TinyMoE()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        load_sharded(path, model, optimizer)
        assert_same(_view(model, optimizer, state), saved)
        torch.testing.assert_close(model(x).detach(), out, rtol=1e-5, atol=1e-6)
    return True


def test_expert_parallel_checkpoint_reshards_to_ep1(tmp_path):
    assert run_on_ranks(_ep2_to_ep1, 2, str(tmp_path / "moe"), timeout=120) == [True, True]
