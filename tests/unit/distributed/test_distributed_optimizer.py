"""The distributed optimizer (ZeRO-1) and bucketed, overlapped gradient reduction through the Trainer:
the same losses as plain data parallelism (AdamW with parameter groups, an LR scheduler, clipping),
optimizer state per rank falling as 1/DP, and checkpoints that resume at other DP/TP sizes, with or
without the distributed optimizer."""

import os

import pytest
import torch
from torch import nn

from lightning_megatron import MegatronStrategy
from lightning_megatron.distributed import (DataParallelGrads, DistributedOptimizer, full_state_dict,
                                            load_full_state_dict)
from lightning_megatron.moe import MoEConfig
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, fit_tiny_gpt

STEPS, CLIP = 10, 0.05
DIST = dict(use_distributed_optimizer=True)
OVERLAP = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=2000)


class AdamWGPT(TinyGPT):
    """AdamW with decay / no-decay groups and a per-step warm-up schedule; reports what the optimizer holds."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() > 1]
        rest = [p for p in self.parameters() if p.dim() <= 1]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                      lr=0.03, betas=(0.9, 0.95))
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def on_train_start(self):
        self.initial = [p.detach().clone() for p in self.parameters()]

    def on_train_end(self):
        self.trainer.strategy.finish_param_sync()   # overlap_param_gather: weights read outside a forward
        optimizer = self.trainer.optimizers[0]
        tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        self.sums = {"state_bytes": sum(v.numel() * v.element_size() for v in tensors),
                     "elementwise_bytes": sum(v.numel() * v.element_size() for v in tensors if v.dim() > 0),
                     "lr": [g["lr"] for g in optimizer.param_groups],
                     "moved": float(sum(((p.detach() - p0).double() ** 2).sum()
                                        for p, p0 in zip(self.parameters(), self.initial)) ** 0.5),
                     "experts_moved": float(sum((p.detach() - p0).double().abs().sum()
                                                for p, p0 in zip(self.parameters(), self.initial)
                                                if getattr(p, "expert_parallel", False)))}


def _fit(kwargs, **extra):
    world = os.environ["WORLD_SIZE"]
    out = fit_tiny_gpt(kwargs, module_cls=AdamWGPT, **{"max_steps": STEPS, **extra,
                                                        "trainer_kwargs": {"gradient_clip_val": CLIP,
                                                                           **extra.get("trainer_kwargs", {})}})
    os.environ["WORLD_SIZE"] = world   # Lightning's teardown removes it; the next Trainer needs it
    return out


def _runs(plan):
    return {name: _fit(kwargs, **extra) for name, kwargs, extra in plan}


TP2SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
PP2 = dict(pipeline_model_parallel_size=2, micro_batch_size=2)
MOE_EDP4 = dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)   # experts reduced over edp=4
MOE_EDP1 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)    # experts alone, yet from dp=2
MOE = dict(module_kwargs=dict(moe=MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2,
                                            dispatcher="alltoall"), moe_layer_freq=2))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dp4") / "ckpt")
    plan = [(f"{layout}/{mode}", {**base, **extra}, {}) for layout, base in
            (("dp4", {}), ("dp2tp2", TP2SP), ("pp2dp2", PP2)) for mode, extra in
            (("plain", {}), ("dist", DIST), ("overlap", OVERLAP)) if not (layout == "pp2dp2" and mode == "dist")]
    plan += [(f"{name}/{mode}", {**base, **extra}, MOE) for name, base in (("moe-edp4", MOE_EDP4),
             ("moe-edp1", MOE_EDP1)) for mode, extra in (("plain", {}), ("overlap", OVERLAP))]
    plan.append(("save", OVERLAP, dict(max_steps=2, dataset_size=16, checkpoint_to=folder)))
    plan.append(("save-tp2", {**TP2SP, **DIST}, dict(max_steps=2, dataset_size=16, checkpoint_to=folder + "-tp2")))
    return run_on_ranks(_runs, 4, plan, timeout=240), folder


@pytest.fixture(scope="module")
def world2(world4, tmp_path_factory):
    _, dp4_folder = world4
    dp2_folder = str(tmp_path_factory.mktemp("dp2") / "ckpt")
    accumulate = dict(trainer_kwargs=dict(accumulate_grad_batches=2), max_steps=4)
    short = dict(max_steps=2, dataset_size=16)
    plan = [("dp2/plain", {}, {}), ("dp2/dist", DIST, {}), ("dp2/overlap", OVERLAP, {}),
            ("dp2/buffers", dict(overlap_grad_reduce=True, bucket_size=2000), {}),
            ("accumulate/plain", dict(micro_batch_size=2), accumulate),
            ("accumulate/overlap", dict(micro_batch_size=2, **OVERLAP), accumulate),
            ("bf16/dist", dict(grad_reduce_in_fp32=True, **OVERLAP), dict(trainer_kwargs=dict(precision="bf16-true"))),
            # the reference: plain DP2 saving and resuming the same way (Lightning restarts the epoch)
            ("first/plain", {}, dict(short, checkpoint_to=dp2_folder)),
            ("resumed/plain", {}, dict(short, max_steps=4, resume_from=dp2_folder)),
            ("resumed/dp4", DIST, dict(short, max_steps=4, resume_from=dp4_folder)),
            # one checkpoint format with and without the distributed optimizer, resharding TP too
            ("resumed/dp4-plain", {}, dict(short, max_steps=4, resume_from=dp4_folder)),
            ("resumed/tp2dp2-dp2", DIST, dict(short, max_steps=4, resume_from=dp4_folder + "-tp2")),
            ("resumed/plain-dist", DIST, dict(short, max_steps=4, resume_from=dp2_folder))]
    return run_on_ranks(_runs, 2, plan, timeout=240)


def _close(a, b, what=""):
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6), what   # float32: only summation order differs


@pytest.mark.parametrize("layout", ["dp4", "dp2tp2", "pp2dp2", "moe-edp4", "moe-edp1"])
def test_losses_match_plain_data_parallel_on_four_ranks(world4, layout):
    out, _ = world4
    for rank_out in out:
        plain = rank_out[f"{layout}/plain"]
        assert len(plain["losses"]) == STEPS and plain["probe"]["moved"] > 0.5   # the steps are not negligible
        for mode in ("dist", "overlap"):
            if f"{layout}/{mode}" in rank_out:
                _close(rank_out[f"{layout}/{mode}"]["losses"], plain["losses"], f"{layout}/{mode}")
                _close(rank_out[f"{layout}/{mode}"]["probe"]["moved"], plain["probe"]["moved"], f"{layout}/{mode}")
                # expert updates are too small to show in the losses: compare them on their own
                assert rank_out[f"{layout}/{mode}"]["probe"]["experts_moved"] == pytest.approx(
                    plain["probe"]["experts_moved"], rel=1e-4), f"{layout}/{mode}"


def test_losses_match_plain_data_parallel_on_two_ranks(world2):
    for rank_out in world2:
        plain = rank_out["dp2/plain"]
        for mode in ("dist", "overlap", "buffers"):
            _close(rank_out[f"dp2/{mode}"]["losses"], plain["losses"])


def test_lr_scheduler_keeps_steering_the_sharded_optimizer(world2):
    for rank_out in world2:
        plain, dist_lrs = rank_out["dp2/plain"]["probe"]["lr"], rank_out["dp2/dist"]["probe"]["lr"]
        assert dist_lrs == plain and plain[0] == pytest.approx(0.03)   # warm-up reached the peak LR


def test_optimizer_state_per_rank_falls_as_one_over_dp(world4, world2):
    out, _ = world4
    full = out[0]["dp4/plain"]["probe"]["elementwise_bytes"]      # unsharded AdamW: exp_avg + exp_avg_sq
    for dp, ranks in ((4, [o["dp4/dist"] for o in out]), (2, [o["dp2/dist"] for o in world2])):
        per_rank = [r["probe"]["elementwise_bytes"] for r in ranks]
        assert sum(per_rank) == full                               # every element's state held exactly once
        assert max(per_rank) <= full / dp * 1.1, (dp, per_rank, full)
        assert max(r["probe"]["state_bytes"] for r in ranks) < out[0]["dp4/plain"]["probe"]["state_bytes"] / dp * 1.1
    # dp2 x tp2: each tp rank's half of the model, split over its two dp ranks
    tp_half = out[0]["dp2tp2/plain"]["probe"]["elementwise_bytes"]
    assert out[0]["dp2tp2/dist"]["probe"]["elementwise_bytes"] + out[2]["dp2tp2/dist"]["probe"]["elementwise_bytes"] \
        == tp_half


def test_accumulation_across_batches_reduces_only_before_the_step(world2):
    for rank_out in world2:
        assert len(rank_out["accumulate/plain"]["losses"]) == 8
        _close(rank_out["accumulate/overlap"]["losses"], rank_out["accumulate/plain"]["losses"])


def test_bf16_with_float32_main_params_and_reduction_tracks_float32(world2):
    for rank_out in world2:
        assert rank_out["bf16/dist"]["losses"] == pytest.approx(rank_out["dp2/plain"]["losses"], rel=2e-2)


def test_resume_dp4_checkpoint_into_dp2_continues_identically(world4, world2):
    out, _ = world4
    for rank_out in world2:
        _close(out[0]["save"]["losses"], rank_out["first/plain"]["losses"])
        resumed = rank_out["resumed/dp4"]["losses"]
        assert len(resumed) == 2
        _close(resumed, rank_out["resumed/plain"]["losses"])


def test_distributed_optimizer_checkpoints_reshard_tp_and_load_without_it(world4, world2):
    """DP4 (sharded optimizer) → plain DP2; TP2·DP2 (sharded) → TP1·DP2 (sharded); plain DP2 → sharded
    DP2: the same continuation as the plain DP2 save and resume."""
    out, _ = world4
    _close(out[0]["save-tp2"]["losses"], out[0]["save"]["losses"])
    for rank_out in world2:
        for name in ("resumed/dp4-plain", "resumed/tp2dp2-dp2", "resumed/plain-dist"):
            assert len(rank_out[name]["losses"]) == 2, name
            _close(rank_out[name]["losses"], rank_out["resumed/plain"]["losses"], name)


# -- in one process ------------------------------------------------------------------------------


def _sharded(model, optimizer, **kwargs):
    grads = DataParallelGrads(list(model.parameters()), dense_group=None, shard=True, **kwargs)
    return grads, DistributedOptimizer([optimizer], grads, [model])


@pytest.mark.parametrize("optimizer_cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_optimizers_that_are_not_elementwise_are_refused(optimizer_cls):
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=f"cannot shard {optimizer_cls.__name__}.*use_distributed_optimizer=False"):
        _sharded(model, optimizer_cls(model.parameters()))


def test_unknown_optimizer_class_must_declare_itself_shardable():
    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"Mine.shardable = True"):
        _sharded(model, Mine(model.parameters()))
    Mine.shardable = True
    fresh = nn.Linear(4, 4)
    _, dist_opt = _sharded(fresh, Mine(fresh.parameters()))
    assert [p.numel() for p in dist_opt.main_params] == [4, 16]   # bias, weight: backward order


def test_strategy_arguments_are_checked():
    with pytest.raises(ValueError, match="overlap_param_gather=True .* use_distributed_optimizer=True"):
        MegatronStrategy(overlap_param_gather=True)
    with pytest.raises(ValueError, match="bucket_size must be >= 1"):
        MegatronStrategy(bucket_size=0)


def _train(model, optimizer, dist_opt, grads, steps=3):
    for step in range(steps):
        grads.zero_grad() if grads is not None else optimizer.zero_grad()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step), dtype=model.weight.dtype)
        model(x).float().square().mean().backward()
        if grads is not None:
            grads.finish_grad_sync()
            dist_opt.attach_grads()
        optimizer.step()
        if dist_opt is not None:
            dist_opt.gather_params()


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adagrad(ps, lr=0.1),          # state made in __init__
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
                                  lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
                                  lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True)])
def test_sharded_optimizer_steps_exactly_like_the_plain_one(make):
    torch.manual_seed(0)
    model, plain_model = nn.Linear(6, 5), nn.Linear(6, 5)
    plain_model.load_state_dict(model.state_dict())
    optimizer, plain = make(model.parameters()), make(plain_model.parameters())
    grads, dist_opt = _sharded(model, optimizer)
    _train(model, optimizer, dist_opt, grads)
    _train(plain_model, plain, None, None)
    assert torch.equal(model.weight, plain_model.weight) and torch.equal(model.bias, plain_model.bias)


def test_full_state_dict_is_torch_format_and_round_trips_with_float32_masters():
    torch.manual_seed(0)
    model = nn.Linear(6, 5).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    grads, dist_opt = _sharded(model, optimizer, grad_reduce_in_fp32=True)
    _train(model, optimizer, dist_opt, grads)
    full = full_state_dict(dist_opt, optimizer)
    assert set(full["state"]) == {0, 1} and full["state"][0]["exp_avg"].shape == model.weight.shape
    assert full["main_params"][0].dtype == torch.float32
    assert torch.equal(full["main_params"][0].bfloat16(), model.weight.detach())
    # into a fresh model + sharded optimizer: same state, same masters, same next step
    torch.manual_seed(1)
    other = nn.Linear(6, 5).to(torch.bfloat16)
    other.load_state_dict(model.state_dict())
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    other_grads, other_dist = _sharded(other, other_opt, grad_reduce_in_fp32=True)
    load_full_state_dict(other_dist, other_opt, full)
    assert other_opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(other_dist.shards[0].main, dist_opt.shards[0].main)
    _train(model, optimizer, dist_opt, grads, steps=1)
    _train(other, other_opt, other_dist, other_grads, steps=1)
    assert torch.equal(model.weight, other.weight)
    # and into a plain torch optimizer (the format is torch's own)
    plain = torch.optim.AdamW(nn.Linear(6, 5).parameters(), lr=0.5)
    plain.load_state_dict(full)
    assert plain.param_groups[0]["lr"] == 0.1


def test_sharded_checkpoint_of_the_distributed_optimizer_keeps_float32_masters(tmp_path):
    """The checkpoint writer sees the distributed optimizer as the plain optimizer over the model (state
    gathered over DP) plus the float32 masters; reading it back restores masters, moments, hyper-parameters
    and the next step exactly."""
    from lightning_megatron.checkpoint import load_sharded, save_sharded
    from lightning_megatron.distributed import FullOptimizerView

    torch.manual_seed(0)
    model = nn.Linear(6, 5).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    grads, dist_opt = _sharded(model, optimizer, grad_reduce_in_fp32=True)
    _train(model, optimizer, dist_opt, grads)
    view = FullOptimizerView.gather(dist_opt, optimizer)
    assert view.state[model.weight]["main_param"].dtype == torch.float32
    save_sharded(str(tmp_path / "ckpt"), [model], [view])

    torch.manual_seed(1)
    other = nn.Linear(6, 5).to(torch.bfloat16)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    other_grads, other_dist = _sharded(other, other_opt, grad_reduce_in_fp32=True)
    load_sharded(str(tmp_path / "ckpt"), [other], [FullOptimizerView.to_load(other_dist, other_opt)])
    assert other_opt.param_groups[0]["lr"] == 0.1
    for mine, theirs in zip(dist_opt.shards, other_dist.shards):
        assert torch.equal(mine.main, theirs.main)                       # masters, not the bf16 rounding
    for p, q in zip(optimizer.param_groups[0]["params"], other_opt.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], other_opt.state[q][key])
    _train(model, optimizer, dist_opt, grads, steps=1)
    _train(other, other_opt, other_dist, other_grads, steps=1)
    assert torch.equal(model.weight, other.weight)


def test_the_overlapped_gather_waits_before_the_modules_other_pre_hooks():
    """A module's own wait for its parameters' all-gather runs before any pre-hook registered on it earlier (the
    float8 weights' casts read the parameters in one): otherwise that hook would read a weight mid-gather."""
    from types import SimpleNamespace

    from lightning_megatron.distributed.param_buffer import ParamGather

    log = []
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda module, args: log.append("earlier hook"))
    bucket = SimpleNamespace(index=0)
    grads = SimpleNamespace(params=list(layer.parameters()), bucket_of={id(p): bucket for p in layer.parameters()})
    buffer = SimpleNamespace(grads=grads, wait=lambda b: log.append("waited for the gather"))
    gather = ParamGather([buffer], [layer], overlap=True)
    layer(torch.ones(1, 4))
    assert log == ["waited for the gather", "earlier hook"]
    gather.remove_hooks()
