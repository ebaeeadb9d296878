"""``hf_pooled`` across pipeline stages: refused at build, with the fix, where a stage would hang its peers."""

import pytest

from lightning_megatron.moe import MoEConfig
from lightning_megatron.moe.pooled_aux_loss import check_pooled_layout
from lightning_megatron.transformer import TransformerConfig


def _config(aux_loss_type="hf_pooled", moe_layer_freq=1):
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, topk=2, aux_loss_type=aux_loss_type)
    return TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4, moe=moe,
                             moe_layer_freq=moe_layer_freq)


def test_every_stage_with_an_moe_layer_passes():
    check_pooled_layout(_config(), [2, 2], 2, None)
    check_pooled_layout(_config(moe_layer_freq=2), [2, 2], 2, None)     # layers 1 and 3 are MoE
    check_pooled_layout(_config(), [0, 4], 1, None)                      # one stage: nothing to pool across
    check_pooled_layout(_config("per_layer"), [0, 4], 2, None)           # per-layer losses need no peers


@pytest.mark.parametrize("layout,freq,stage", [([0, 4], 1, 0), ([3, 1], 2, 1)])
def test_a_stage_without_an_moe_layer_is_refused(layout, freq, stage):
    with pytest.raises(ValueError, match=f"stage {stage} of pipeline_layout=.*choose a pipeline_layout"):
        check_pooled_layout(_config(moe_layer_freq=freq), layout, 2, None)


def test_virtual_stages_are_refused():
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2.*per_layer"):
        check_pooled_layout(_config(), [1, 1, 1, 1], 2, 2)
