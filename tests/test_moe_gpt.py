"""A GPT whose MLPs are MoE layers trains under the strategy at EP2xTP2 (and EP2xDP2) exactly as at EP1."""

import pytest

from lightning_megatron.moe import MoEConfig
from lightning_megatron.testing import run_on_ranks
from strategy_utils import fit_tiny_gpt


def moe(dispatcher):
    return dict(moe=MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2, dispatcher=dispatcher),
                moe_layer_freq=2)


@pytest.mark.parametrize("dispatcher, world, kwargs", [
    ("alltoall", 4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)),    # etp2 ep2: edp1
    ("allgather", 4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)),
    ("alltoall", 4, dict(expert_model_parallel_size=2)),                                  # dp4, ep2: edp2
    ("alltoall", 4, dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)),   # edp4 holds tp shares
])
def test_moe_gpt_trains_like_a_single_process(dispatcher, world, kwargs):
    module_kwargs = moe(dispatcher)
    ref = run_on_ranks(fit_tiny_gpt, 1, dict(), trainer_kwargs=dict(gradient_clip_val=0.5),
                       module_kwargs=module_kwargs, timeout=120)[0]
    out = run_on_ranks(fit_tiny_gpt, world, kwargs, trainer_kwargs=dict(gradient_clip_val=0.5),
                       module_kwargs=module_kwargs, timeout=180)
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
