"""What a user's ``configure_optimizers`` and optimization style meet under the strategy, from the public API.

- Parameter groups that treat the tied word embedding as one weight train like one process at pp2 (where it
  is two parameters); groups that split its two copies are refused on every rank, middle stages included,
  instead of silently untying them (a rule by name picked ``word_embeddings`` and missed ``output_weight``:
  found by a probe, 0.6 relative off one process after two steps).
- Manual optimization is refused on every rank (``manual_backward`` ran no backward and ``opt.step()`` stepped
  before the schedule's backward: silently no update at dp2, stale gradients and a crash at tp2, a desync at
  pp2).
"""

import lightning as L
import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, assert_same_updates, fit_and_record, fit_tiny_gpt


class GroupedGPT(TinyGPT):
    """SGD with the word embeddings in their own group (another lr and weight decay). ``rule="both"`` picks the
    tied weight by both of its names; ``"name"`` by the word embeddings' name only (misses ``output_weight``)."""

    def __init__(self, rule="both", **kwargs):
        super().__init__(**kwargs)
        self.rule = rule

    def configure_optimizers(self):
        def embedding(name):
            return "word_embeddings" in name or (self.rule == "both" and name.endswith("output_weight"))

        named = list(self.named_parameters())
        return torch.optim.SGD([
            {"params": [p for n, p in named if embedding(n)], "lr": 0.5, "weight_decay": 0.01},
            {"params": [p for n, p in named if not embedding(n)], "lr": 2.0, "weight_decay": 0.0}], lr=2.0)


def _grouped_updates(kwargs, rule):
    return fit_and_record(kwargs, module_cls=GroupedGPT, module_kwargs=dict(rule=rule))["params"]


@pytest.mark.parametrize("kwargs", [dict(pipeline_model_parallel_size=2, micro_batch_size=2),
                                    dict(pipeline_model_parallel_size=2, micro_batch_size=2,
                                         virtual_pipeline_model_parallel_size=2)], ids=["pp2", "pp2-vpp2"])
def test_tied_embedding_in_one_parameter_group_trains_like_one_process(kwargs):
    ref = run_on_ranks(_grouped_updates, 1, dict(), "both", timeout=120)[0]
    got = run_on_ranks(_grouped_updates, 2, kwargs, "both", timeout=180)[0]
    assert_same_updates(got, ref)
    # the groups mattered: the embeddings moved by another lr than the rest
    plain = run_on_ranks(fit_and_record, 1, dict(), timeout=120)[0]["params"]
    with pytest.raises(AssertionError):
        assert_same_updates(plain, ref)


def _grouped_error(kwargs, rule):
    try:
        fit_tiny_gpt(kwargs, module_cls=GroupedGPT, module_kwargs=dict(rule=rule), max_steps=1)
    except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(err).__name__}: {err}"
    return None


def test_tied_embedding_split_over_parameter_groups_is_refused_on_every_rank():
    out = run_on_ranks(_grouped_error, 4, dict(pipeline_model_parallel_size=4, micro_batch_size=2), "name",
                       timeout=180)
    assert out[0] is not None and out[0].startswith("ValueError: the tied word embedding is two parameters"), out[0]
    assert all(o == out[0] for o in out), out   # the middle stages, which hold no copy, raise it too
    for shown in ("word_embeddings.weight", "output_weight", "lr=0.5", "lr=2.0", "weight_decay=0.01",
                  "shared_embedding"):
        assert shown in out[0], out[0]


def test_one_stage_holds_one_tied_parameter_and_any_grouping_is_fine():
    assert run_on_ranks(_grouped_error, 1, dict(), "name", timeout=120) == [None]


class ManualGPT(TinyGPT):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self(batch).mean()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def _manual_error(kwargs):
    try:
        fit_tiny_gpt(kwargs, module_cls=ManualGPT, max_steps=2)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize("world, kwargs", [(1, dict()), (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
                                           (2, dict(use_distributed_optimizer=True))], ids=["one", "pp2", "dp2-distopt"])
def test_manual_optimization_is_refused_on_every_rank(world, kwargs):
    out = run_on_ranks(_manual_error, world, kwargs, timeout=120)
    assert out[0] is not None and out[0].startswith("ValueError: ManualGPT sets automatic_optimization = False"), out[0]
    assert all(o == out[0] for o in out), out


# --- gradients as a hook sees them: the whole model's norm, and edits that reach the update ---------------

class GradHook(L.Callback):
    """In ``on_before_optimizer_step``: record ``strategy.grad_norm()`` (2 and inf) and, with ``halve``, halve
    the gradients where the optimizer reads them (under the distributed optimizer: its float32 shards)."""

    def __init__(self, halve=False):
        self.halve, self.norms = halve, []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.norms.append((float(trainer.strategy.grad_norm()), float(trainer.strategy.grad_norm(float("inf")))))
        if self.halve:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(0.5)


def _hooked(kwargs, halve):
    hook = GradHook(halve)
    out = fit_and_record(kwargs, trainer_kwargs=dict(callbacks=[hook]))
    return {"norms": hook.norms, "params": out["params"]}


def _plain_norms():
    """One process without the strategy: torch's own norm of every gradient, before each step."""
    norms = []

    class Torch(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            norms.append((float(torch.nn.utils.get_total_norm(grads)),
                          float(torch.nn.utils.get_total_norm(grads, norm_type=float("inf")))))

    fit_tiny_gpt(dict(), max_steps=3, trainer_kwargs=dict(callbacks=[Torch()]))
    return norms


LAYOUTS = {"tp2": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
           "pp2": (2, dict(pipeline_model_parallel_size=2, micro_batch_size=2)),
           "dp2-distopt": (2, dict(use_distributed_optimizer=True)),
           "tp2-dp2-distopt": (4, dict(tensor_model_parallel_size=2, use_distributed_optimizer=True))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grad_norm_is_one_process_norm_on_every_rank_and_edits_reach_the_update(layout):
    world, kwargs = LAYOUTS[layout]
    unhalved = run_on_ranks(_hooked, 1, dict(), False, timeout=120)[0]
    assert _flat(unhalved["norms"]) == pytest.approx(_flat(run_on_ranks(_plain_norms, 1, timeout=120)[0]), rel=1e-6)
    ref = run_on_ranks(_hooked, 1, dict(), True, timeout=120)[0]
    out = run_on_ranks(_hooked, world, kwargs, True, timeout=180)
    for rank in out:
        assert _flat(rank["norms"]) == pytest.approx(_flat(ref["norms"]), rel=1e-5)
    assert_same_updates(out[0]["params"], ref["params"])
    with pytest.raises(AssertionError):   # the halving mattered: without it the updates differ
        assert_same_updates(unhalved["params"], ref["params"])


def _flat(norms):
    return [value for pair in norms for value in pair]


def _norm_outside_fit():
    from lightning_megatron import MegatronStrategy

    strategy = MegatronStrategy()
    try:
        strategy.grad_norm()
    except RuntimeError as err:
        return str(err)
    return None


def test_grad_norm_outside_a_training_step_says_when_to_call_it():
    assert "call it while fitting" in run_on_ranks(_norm_outside_fit, 1, timeout=60)[0]
