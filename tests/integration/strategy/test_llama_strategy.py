"""Llama (rotary embeddings, grouped-query attention, SwiGLU, RMSNorm, untied output) and Mixtral (its MoE
variant) train under the strategy exactly as in one process, parameter by parameter after every step
(unclipped SGD, lr 2: see test_strategy_updates.py). The layouts are those where Llama differs from GPT:
key/value heads split over tp and shared by tp ranks (tp4 > 2 kv heads: the shared heads' gradients
must be summed), rotary angles under sequence parallelism and at the load-balanced context-parallel
positions, the untied output layer over pipeline stages, and Mixtral's experts over ep/etp (its ep2 run
is also data-parallel: dp2 for the attention weights Llama and Mixtral share). Packed rows (several
documents per row: positions restarting, attention within each document) train the same too, the
documents' ids split with the sequence under cp and travelling with the keys.
"""

import pytest

from lightning_megatron.models.llama import LlamaModel, llama_config, mixtral_config
from lightning_megatron.pipeline import VirtualChunks
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import (SEQ, VOCAB, AuxLoggingGPT, PackedTokenData, TinyGPT, assert_same_updates,
                                    fit_and_record)


class TinyLlama(TinyGPT):
    """4 heads of 4 channels over 2 key/value heads; ``mixtral = True`` makes it a Mixtral of 4 experts."""

    def configure_model(self):
        shape = dict(num_layers=self.layers, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=24, rotary_base=100.0, **self.config)
        cfg = mixtral_config(num_experts=4, topk=2, moe_overrides=dict(aux_loss_coeff=0.5), **shape) \
            if self.mixtral else llama_config(**shape)
        self.model = VirtualChunks(lambda vp_rank: LlamaModel(cfg, VOCAB, SEQ, vp_rank=vp_rank))

    mixtral = False


class TinyMixtral(AuxLoggingGPT, TinyLlama):
    mixtral = True


class PackedLlama(TinyLlama):
    """Trained on ``PackedTokenData``: every stage's model gets the micro-batch's positions and documents."""

    def forward(self, batch):
        return self.model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                          document_ids=batch["document_ids"])


class PackedMixtral(AuxLoggingGPT, PackedLlama):
    mixtral = True


LLAMA = {
    "cp2": (2, dict(context_parallel_size=2)),
    "pp2vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, micro_batch_size=2)),
    "tp4": (4, dict(tensor_model_parallel_size=4)),                             # each kv head on 2 ranks
    "tp2cp2sp": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2,   # 1 kv head per tp rank
                         sequence_parallel=True)),
}
PACKED = {
    "packed-tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "packed-pp2vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               micro_batch_size=2)),
    "packed-cp2": (2, dict(context_parallel_size=2)),
    "packed-dp2": (2, dict()),
}
PACKED_MIXTRAL = {
    "packed-ep2": (2, dict(expert_model_parallel_size=2)),   # dp2 for attention, experts over ep
    "packed-tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
}
# the MoE machinery's own layouts (cp, pp, dp, buffers, ...) are test_strategy_updates.py's
MIXTRAL = {
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),   # experts etp2
}


@pytest.fixture(scope="module")
def llama_reference():
    return run_on_ranks(fit_and_record, 1, dict(), module_cls=TinyLlama, timeout=120)[0]


@pytest.fixture(scope="module")
def packed_reference():
    return run_on_ranks(fit_and_record, 1, dict(), module_cls=PackedLlama, dataset=PackedTokenData(), timeout=120)[0]


@pytest.fixture(scope="module")
def packed_mixtral_reference():
    return run_on_ranks(fit_and_record, 1, dict(micro_batch_size=1), module_cls=PackedMixtral,
                        dataset=PackedTokenData(), timeout=120)[0]


@pytest.fixture(scope="module")
def mixtral_reference():
    # one sample per micro-batch: the balancing loss is a function of a micro-batch's tokens
    return run_on_ranks(fit_and_record, 1, dict(micro_batch_size=1), module_cls=TinyMixtral, timeout=120)[0]


@pytest.mark.parametrize("name", list(LLAMA))
def test_llama_updates_match_single_process(llama_reference, name):
    world, kwargs = LLAMA[name]
    out = run_on_ranks(fit_and_record, world, kwargs, module_cls=TinyLlama, timeout=240)
    assert_same_updates(out[0]["params"], llama_reference["params"])
    assert {"model.decoder.layers.0.attention.q.weight", "model.decoder.layers.0.attention.kv.weight",
            "model.output_weight"} <= out[0]["params"][0].keys()
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(llama_reference["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_llama_updates_match_single_process(packed_reference, name):
    world, kwargs = PACKED[name]
    out = run_on_ranks(fit_and_record, world, kwargs, module_cls=PackedLlama, dataset=PackedTokenData(), timeout=240)
    assert_same_updates(out[0]["params"], packed_reference["params"])
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(packed_reference["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", list(MIXTRAL))
def test_mixtral_updates_match_single_process(mixtral_reference, name):
    world, kwargs = MIXTRAL[name]
    out = run_on_ranks(fit_and_record, world, dict(micro_batch_size=1, **kwargs), module_cls=TinyMixtral,
                       timeout=240)
    assert_same_updates(out[0]["params"], mixtral_reference["params"])
    assert "load_balancing_loss" in mixtral_reference["logged"]
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(mixtral_reference["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", list(PACKED_MIXTRAL))
def test_packed_mixtral_updates_match_single_process(packed_mixtral_reference, name):
    """Packed rows through the MoE layer (balancing losses on): routing sees every token, attention stays
    within each document."""
    world, kwargs = PACKED_MIXTRAL[name]
    out = run_on_ranks(fit_and_record, world, dict(micro_batch_size=1, **kwargs), module_cls=PackedMixtral,
                       dataset=PackedTokenData(), timeout=240)
    assert_same_updates(out[0]["params"], packed_mixtral_reference["params"])
    assert "load_balancing_loss" in packed_mixtral_reference["logged"]
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(packed_mixtral_reference["losses"], rel=1e-5, abs=1e-6)


def _export(checkpoint, out_dir, ids):
    """Export a strategy checkpoint (saved at TP2) from one process; our logits for ``ids``."""
    import torch

    from lightning_megatron.checkpoint.hf_llama import export_hf_llama
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    ParallelState(ParallelLayout(1)).activate()
    module = TinyLlama()
    module.configure_model()
    export_hf_llama(checkpoint, module.model, out_dir, prefix="model.", max_shard_size="20KB")
    with torch.inference_mode():   # (as Lightning validates) the cached rotary angles must not leak into
        logits = module.model.eval()(ids)[..., :VOCAB].clone()
    module.model.train()(ids, labels=ids).mean().backward()   # a training step's autograd
    return logits


def test_trained_checkpoint_exports_to_transformers(tmp_path):
    import torch
    import transformers

    checkpoint, out_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_on_ranks(fit_and_record, 2, dict(tensor_model_parallel_size=2), max_steps=1, module_cls=TinyLlama,
                 checkpoint_to=checkpoint, timeout=120)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ours = run_on_ranks(_export, 1, checkpoint, out_dir, ids, timeout=120)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-5, rtol=1e-5)


# Qwen-style attention: q/k/v biases and per-head query/key norms, whose one weight serves every tp rank's heads
# (its gradient is a sum over tp: a missing reduction shows at tp4 and under sequence parallelism)
QWEN = dict(add_qkv_bias=True, qk_layernorm=True)
QWEN_LAYOUTS = {
    "tp4": (4, dict(tensor_model_parallel_size=4)),
    "tp2cp2sp": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def qwen_reference():
    return run_on_ranks(fit_and_record, 1, dict(), module_cls=TinyLlama, module_kwargs=QWEN, timeout=120)[0]


@pytest.mark.parametrize("name", list(QWEN_LAYOUTS))
def test_qwen_attention_updates_match_single_process(qwen_reference, name):
    world, kwargs = QWEN_LAYOUTS[name]
    out = run_on_ranks(fit_and_record, world, kwargs, module_cls=TinyLlama, module_kwargs=QWEN, timeout=240)
    assert any("q_norm" in key for key in out[0]["params"][0])
    assert_same_updates(out[0]["params"], qwen_reference["params"])


# Gemma 2 and OLMo-2 layers in one model: norms before and after each sub-block, query/key RMSNorms over all heads
# (one weight per channel of every head, kept whole on each tp rank: its gradient is a sum over tp, and the shared
# key/value heads at tp4 count once), a window of 3 < SEQ on layers 1 and 3, scaled and soft-capped scores and
# soft-capped logits; the weights are initialised 10x larger so the caps bend the scores and logits, and SGD's lr is
# 0.05: at lr 2 the output norms (of near-zero sub-block outputs) make the steps chaotic, float32 noise included
GEMMA2_OLMO2 = dict(layernorm_order="sandwich", qk_layernorm=True, qk_layernorm_across_heads=True, sliding_window=3,
                    sliding_window_layers=[1, 3], softmax_scale=0.3, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0, init_method_std=0.2, lr=0.05)
GEMMA2_OLMO2_LAYOUTS = {
    "tp4sp": (4, dict(tensor_model_parallel_size=4, sequence_parallel=True)),
    "tp2pp2sp": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True,
                         micro_batch_size=2)),
}


@pytest.fixture(scope="module")
def gemma2_olmo2_reference():
    return run_on_ranks(fit_and_record, 1, dict(), module_cls=TinyLlama, module_kwargs=GEMMA2_OLMO2, timeout=120)[0]


@pytest.mark.parametrize("name", list(GEMMA2_OLMO2_LAYOUTS))
def test_sandwich_softcapped_windowed_layers_update_like_single_process(gemma2_olmo2_reference, name):
    world, kwargs = GEMMA2_OLMO2_LAYOUTS[name]
    out = run_on_ranks(fit_and_record, world, kwargs, module_cls=TinyLlama, module_kwargs=GEMMA2_OLMO2, timeout=240)
    assert any("mlp_output_norm" in key for key in out[0]["params"][0])
    assert_same_updates(out[0]["params"], gemma2_olmo2_reference["params"])
