"""A GPT whose MLPs are MoE layers trains under the strategy at EP2xTP2 (and EP2xDP2, and with ECHO
spare slots) exactly as at EP1."""

import pytest

from lightning_megatron.moe import MoEConfig
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, assert_same_run, fit_and_record, fit_tiny_gpt


def moe(dispatcher, spare=0, **options):
    return dict(moe=MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2, dispatcher=dispatcher,
                              num_spare_experts_per_ep_rank=spare, **options),
                moe_layer_freq=2)


@pytest.mark.parametrize("dispatcher, world, kwargs, spare", [
    ("alltoall", 4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), 0),    # etp2 ep2: edp1
    ("allgather", 4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), 0),
    ("alltoall", 4, dict(expert_model_parallel_size=2), 0),                                  # dp4, ep2: edp2
    ("alltoall", 4, dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), 0),   # edp4 holds tp shares
    # ECHO: a spare slot per EP rank; the EP1 reference has none (offloading is off at ep=1)
    ("alltoall", 4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), 1),
    ("allgather", 4, dict(expert_model_parallel_size=4), 1),
])
def test_moe_gpt_trains_like_a_single_process(dispatcher, world, kwargs, spare):
    module_kwargs = moe(dispatcher, spare)
    ref = run_on_ranks(fit_tiny_gpt, 1, dict(), trainer_kwargs=dict(gradient_clip_val=0.5),
                       module_kwargs=module_kwargs, timeout=120)[0]
    out = run_on_ranks(fit_tiny_gpt, world, kwargs, trainer_kwargs=dict(gradient_clip_val=0.5),
                       module_kwargs=module_kwargs, module_cls=EchoProbe, timeout=180)
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        if spare:
            assert rank_out["probe"]["echo_slots_used"] > 0, "the strategy run never offloaded a token"


class EchoProbe(TinyGPT):
    """Counts the spare slots that held an expert copy, over every training batch."""

    def on_train_batch_end(self, *args):
        from lightning_megatron.moe import MoELayer

        super().on_train_batch_end(*args)
        used = sum(int((m.dispatcher.meta.spare_homes >= 0).sum()) for m in self.modules()
                   if isinstance(m, MoELayer) and m.dispatcher.meta.spare_homes is not None)
        self.sums = {"echo_slots_used": getattr(self, "sums", {}).get("echo_slots_used", 0) + used}


class RecordRouters(__import__("lightning").Callback):
    def on_train_batch_end(self, trainer, module, *args):
        from lightning_megatron.moe import TopKRouter

        routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        module.step_losses_aux = getattr(module, "step_losses_aux", [])
        module.step_losses_aux.append((routers[0].aux_loss_scale, float(routers[0].expert_bias.abs().sum())))


def _aux(kwargs):
    from helpers import strategy_utils

    seen = {}

    class Probe(strategy_utils.TinyGPT):
        def on_fit_end(self):
            seen["aux"] = self.step_losses_aux

    config = dict(moe=MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2, aux_loss_coeff=1e-2,
                                enable_expert_bias=True), moe_layer_freq=2)
    out = fit_tiny_gpt(kwargs, module_cls=Probe, module_kwargs=config,
                       trainer_kwargs=dict(accumulate_grad_batches=2, callbacks=[RecordRouters()]))
    return out["losses"], seen["aux"]


def test_aux_loss_scale_and_expert_bias_follow_the_schedule():
    ref_losses, ref_aux = run_on_ranks(_aux, 1, dict(micro_batch_size=2), timeout=120)[0]
    assert [scale for scale, _ in ref_aux] == [pytest.approx(1 / (4 * 2))] * 8    # 4 micro-batches, accumulate 2
    assert ref_aux[-1][1] > 0                                                      # biases moved after steps
    for losses, aux in run_on_ranks(_aux, 2, dict(expert_model_parallel_size=2, micro_batch_size=2), timeout=180):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        # each dp rank runs 2 micro-batches (scale 1/4); averaged over dp=2 that is one process's 1/8
        assert [scale for scale, _ in aux] == [pytest.approx(1 / (2 * 2))] * 8
        assert [bias for _, bias in aux] == pytest.approx([bias for _, bias in ref_aux], rel=1e-5)


class PlanProbe(TinyGPT):
    """Records how many times the MoE layers planned ECHO's offloading in each training step."""

    plans: list = []

    def on_train_batch_end(self, *args):
        super().on_train_batch_end(*args)
        self.sums = {"plans": (getattr(self, "sums", None) or {"plans": []})["plans"] + [len(PlanProbe.plans)]}
        PlanProbe.plans.clear()


def _fit_counting_plans(strategy_kwargs, module_kwargs):
    from lightning_megatron.moe import MoELayer

    offload = MoELayer.offload

    def counted(self, *args):
        PlanProbe.plans.append(1)
        return offload(self, *args)

    MoELayer.offload = counted
    try:
        return fit_and_record(strategy_kwargs, module_kwargs, module_cls=PlanProbe)
    finally:
        MoELayer.offload = offload


@pytest.mark.parametrize("tolerance,recompute,plans", [(100.0, False, [4, 0, 0]), (0.0, False, [4, 4, 4]),
                                                        (100.0, True, [8, 0, 0])])
def test_echo_plans_after_a_step_that_needed_it_and_trains_like_a_single_process(tolerance, recompute, plans):
    """Through the Trainer (the training step tells the layers a step ended): two MoE layers, two micro-batches a
    step on each EP rank: within the tolerance the first step plans and the next route over the home experts, with
    any imbalance (tolerance 0) every step plans; with recomputed layers the recomputation takes its forward's
    path (planned twice in the first step, never after). With the balancing loss on, the losses and updates are
    those of the same layout without ECHO every time (the balancing loss is per micro-batch, whose samples differ
    from one process's at dp2, so one process is not the reference here; ECHO-off EP2 equals it without the loss:
    test_moe_gpt_trains_like_a_single_process)."""
    layout = dict(expert_model_parallel_size=2, micro_batch_size=2)
    without = run_on_ranks(fit_and_record, 2, layout, dict(moe("alltoall", aux_loss_coeff=1e-2),
                                                           recompute_layers=recompute), timeout=180)
    module_kwargs = dict(moe("alltoall", 1, echo_tolerance=tolerance, aux_loss_coeff=1e-2), recompute_layers=recompute)
    out = run_on_ranks(_fit_counting_plans, 2, layout, module_kwargs, timeout=180)
    assert_same_run(out, without[0])
    assert [rank_out["probe"]["plans"] for rank_out in out] == [plans, plans]
