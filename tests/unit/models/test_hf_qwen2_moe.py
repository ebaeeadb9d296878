"""Qwen2-MoE import and export against ``transformers``: q/k/v biases, Qwen3-MoE's expert names, and a shared expert
gated per token by ``sigmoid(mlp.shared_expert_gate(x))`` (``MoEConfig.shared_expert_gate``). The float32 logits and
per-token losses equal Hugging Face's at one rank, TP2 (the shared expert split over tp, its gate replicated), PP2,
EP2 and TP2·EP2; the export from the last layout loads with ``from_pretrained`` and holds the original tensors."""

import pytest
import torch
import transformers

from lightning_megatron.models.hf_llama import config_from_hf
from lightning_megatron.testing import run_on_ranks
from test_hf_llama import BATCH, COMMON, SEQ, VOCAB, _import_matches, load_hf_state

EXTRA = dict(num_hidden_layers=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             shared_expert_intermediate_size=40, norm_topk_prob=False)
LAYOUTS = [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 2, 1, None, 1), (1, 1, 2, None, 1), (2, 1, 2, None, 1)]


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    torch.manual_seed(1)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**COMMON, **EXTRA)).eval()
    with torch.no_grad():   # biases and routers start at zero in transformers; the shared gates then all say 1/2
        for name, param in model.named_parameters():
            if name.endswith(("proj.bias", "gate.weight")):
                param.normal_(0.0, 0.5)
    path = str(tmp_path_factory.mktemp("qwen2_moe"))
    model.save_pretrained(path, max_shard_size="60KB")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    with torch.no_grad():
        logits = model(ids).logits
        positions = (torch.arange(SEQ) % (SEQ // 2 + 3)).expand(BATCH, SEQ)
        positioned = model(ids, position_ids=positions).logits
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return dict(path=path, ids=ids, labels=labels, logits=logits, per_token=per_token, positions=(positions, positioned))


def test_import_gives_transformers_logits_and_export_loads(qwen2_moe, tmp_path):
    q = qwen2_moe
    export = str(tmp_path / "export")
    out = run_on_ranks(_import_matches, 4, q["path"], LAYOUTS, q["ids"], q["labels"], q["logits"], q["per_token"],
                       q["positions"], export, "50KB", timeout=240)
    errors = [e for rank_errors, _ in out for e in rank_errors]
    print(f"qwen2_moe: max |Δlogit| per layout {errors}")
    assert len(errors) >= len(LAYOUTS) and max(errors) < 1e-5
    original, written = load_hf_state(q["path"]), load_hf_state(export)
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(q["ids"]).logits, q["logits"], atol=1e-6, rtol=1e-6)


def test_config_and_refusals():
    hf = dict(COMMON, **EXTRA, model_type="qwen2_moe")
    moe = config_from_hf(hf).moe
    assert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate, moe.pre_softmax) == (40, True, True)
    assert config_from_hf(hf).qkv_bias and not config_from_hf(dict(hf, qkv_bias=False)).qkv_bias
    assert (moe.aux_loss_coeff, config_from_hf(dict(hf, output_router_logits=True)).moe.aux_loss_type) == (0.0, "hf_pooled")
    windowed = config_from_hf(dict(hf, use_sliding_window=True, sliding_window=5, max_window_layers=1))
    assert (windowed.sliding_window, windowed.sliding_window_layers) == (5, (2,))   # layers from max_window_layers on
    with pytest.raises(ValueError, match="layer_types in config.json must give one of"):
        config_from_hf(dict(hf, use_sliding_window=True, sliding_window=5, layer_types=["chunked_attention"] * 2))
    for key, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [0]), ("shared_expert_intermediate_size", 0)):
        with pytest.raises(ValueError, match=key):
            config_from_hf(dict(hf, **{key: value}))
