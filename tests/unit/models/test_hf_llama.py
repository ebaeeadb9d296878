"""Hugging Face Llama / Mistral / Mixtral import and export against ``transformers`` itself.

Tiny models are built from configs (no download), saved as sharded safetensors, imported at
TP1/TP2/PP2(+VPP)/TP2·PP2/TP4 (key/value heads shared by tp ranks)/CP2 (and EP2, TP2·EP2 for
Mixtral): the float32 logits and per-token losses equal Hugging Face's. Exports from a parallel
layout load with ``from_pretrained`` and hold exactly the original tensors.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from lightning_megatron.context_parallel import split_for_context_parallel
from lightning_megatron.models.hf_llama import (
    config_from_hf, load_hf_llama, model_kwargs_from_hf, parse_size, save_hf_llama,
)
from lightning_megatron.models.llama import LlamaModel
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.pipeline import VirtualChunks, forward_backward
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer.rotary import rope_attention_factor, rope_inverse_frequencies
from helpers.tp_utils import gather

VOCAB, SEQ, BATCH = 100, 16, 2
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=VOCAB,
              max_position_embeddings=64)
FAMILIES = {
    # GQA 4:2, Llama-3 rope scaling, untied output layer, 4 layers (PP2·VPP2 has one per chunk)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(num_hidden_layers=4, num_key_value_heads=2,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8))),
    # one key/value head (shared by every tp rank), head_dim 32 != 64/4, tied embeddings, a window of 6 < SEQ
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                     sliding_window=6)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    # biases on q/k/v only (random here: transformers initialises them to zero), GQA 4:2, untied, a window of 6 on
    # the layers from max_window_layers=1 on (the second)
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=True,
                   sliding_window=6, max_window_layers=1,
                   rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                        original_max_position_embeddings=8))),
    # query/key RMSNorms per head (random weights here), head_dim 32 != 64/4, tied embeddings
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    # Hugging Face's fused qkv_proj ([all q; all k; all v]) and gate_up_proj, one key/value head per query head
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(num_hidden_layers=2, num_key_value_heads=4, pad_token_id=0)),
    # LongRoPE: one factor per frequency, the long ones since 16 tokens pass the original context of 12; the second
    # forward's positions (at most 10) stay within it and take the short ones
    "phi3_longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                      dict(num_hidden_layers=2, num_key_value_heads=4, pad_token_id=0,
                           original_max_position_embeddings=12,
                           rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                                                long_factor=[1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 10.0],
                                                original_max_position_embeddings=12))),
    # GeGLU, norms scaling by 1 + weight (random here: transformers starts them at 0), embeddings times sqrt(h),
    # head_dim 32 != 64/4 (Gemma's 256), GQA 4:2, tied embeddings
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM,
              dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, pad_token_id=0)),
    # Qwen3 attention (per-head q/k norms, head_dim 32) and experts named mlp.experts.<e>.gate_proj/up_proj/down_proj
    # with router mlp.gate; top-k probabilities not renormalised (norm_topk_prob=false: softmax over every expert)
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48, norm_topk_prob=False)),
    # Gemma's layers with norms before and after each sub-block, a window of 6 on layers 1 and 3 (layer_types'
    # default), scores scaled by 24 ** -0.5 (not head_dim's), soft-capped scores and logits: weights 10x Gemma's
    # initial scale, so scores reach ~15 and logits ~10 and both caps bend them
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=32, pad_token_id=0, sliding_window=6,
                    query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                    initializer_range=0.2)),
    # Gemma 2's layers with per-head (1 + weight) q/k norms and no soft-caps; windowed layers 1 and 3 rotate by their
    # own base (10^4), the others by 10^6 with linear scaling
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=32, pad_token_id=0, sliding_window=6,
                         query_pre_attn_scalar=24,
                         layer_types=["sliding_attention", "full_attention"] * 2,
                         rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                          "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    # OLMo-2's layers, a window of 6 on all but every 4th layer (layer_types' default), the windowed layers rotating by
    # a base of their own
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM,
              dict(num_hidden_layers=4, num_key_value_heads=2, pad_token_id=0, sliding_window=6,
                   rope_parameters={"full_attention": dict(rope_type="default", rope_theta=5e5),
                                    "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    # norms on each sub-block's output only; q/k RMSNorms over all heads at once (weights of 4·16 and 2·16)
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM,
              dict(num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0)),
}
# (tp, pp, ep, vp, cp), run in one world of 4 (other ranks are dp replicas); the last one exports
LAYOUTS = {
    "llama": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 2, 1, 2, 1), (1, 1, 1, None, 2), (4, 1, 1, None, 1),
              (2, 2, 1, None, 1)],
    "mistral": [(1, 1, 1, None, 1), (1, 2, 1, None, 1), (4, 1, 1, None, 1), (1, 1, 1, None, 2), (2, 2, 1, None, 1)],
    "mixtral": [(1, 1, 1, None, 1), (2, 2, 1, None, 1), (1, 1, 2, None, 1), (2, 1, 2, None, 1)],
    "qwen2": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 2, 1, None, 1), (1, 1, 1, None, 2),
              (2, 2, 1, None, 1)],
    "qwen3": [(1, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 1, 1, None, 2), (2, 2, 1, None, 1)],
    "phi3": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 2, 1, None, 1), (2, 2, 1, None, 1)],
    # (explicit position_ids with LongRoPE are refused under context parallelism, and this test passes them)
    "phi3_longrope": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 2, 1, None, 1), (2, 2, 1, None, 1)],
    "gemma": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 2, 1, None, 1), (1, 1, 1, None, 2), (2, 2, 1, None, 1)],
    "qwen3_moe": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 1, 2, None, 1), (2, 1, 2, None, 1), (2, 2, 1, None, 1)],
    # soft-capped attention is refused under context parallelism
    "gemma2": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 2, 1, 2, 1), (2, 2, 1, None, 1)],
    "gemma3_text": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 1, 1, None, 2), (1, 2, 1, 2, 1), (2, 2, 1, None, 1)],
    "olmo3": [(1, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 1, 1, None, 2), (2, 2, 1, None, 1)],
    "olmo2": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (4, 1, 1, None, 1), (1, 1, 1, None, 2), (2, 2, 1, None, 1)],
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each family's sharded HF directory, inputs, HF logits, per-token losses and loss."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)   # HF shifts inside; we do not
    for kind, (config_cls, model_cls, extra) in FAMILIES.items():
        torch.manual_seed(1)
        model = model_cls(config_cls(**COMMON, **extra)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("proj.bias", "q_norm.weight", "k_norm.weight")):
                    param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
                elif kind.startswith("gemma") and name.endswith("norm.weight"):   # zero-centred: 0 is the identity
                    param.normal_(0.0, 0.5)
                elif kind.startswith("olmo") and name.endswith("layernorm.weight"):   # which norm is which shows
                    param.normal_(1.0, 0.5)
                elif kind.startswith("gemma") and name.endswith("gate_proj.weight"):   # gates of order 1, where the tanh
                    param.normal_(0.0, 0.3)                                   # GELU is not the exact one
        path = str(tmp_path_factory.mktemp(kind))
        model.save_pretrained(path, max_shard_size="60KB")
        with torch.no_grad():
            hf = model(ids, labels=ids)
            # explicit positions (restarting mid-sequence, as packed documents will): only the rotary angles change
            positions = (torch.arange(SEQ) % (SEQ // 2 + 3)).expand(BATCH, SEQ)
            positioned = model(ids, position_ids=positions).logits
        per_token = F.cross_entropy(hf.logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
        assert per_token.sum() / (labels != -100).sum() == pytest.approx(float(hf.loss), rel=1e-6)
        out[kind] = dict(path=path, ids=ids, labels=labels, logits=hf.logits, per_token=per_token, loss=float(hf.loss),
                         positions=(positions, positioned))
    return out


def test_checkpoints_are_sharded(families):
    for kind, fam in families.items():
        with open(os.path.join(fam["path"], "model.safetensors.index.json")) as f:
            assert len(set(json.load(f)["weight_map"].values())) > 2, kind


def _last_stage_outputs(model, state, ids, labels, hidden, positions):
    """Logits (full vocabulary), per-token loss and logits at ``positions`` from the last stage; None elsewhere."""
    def step(mb, chunk, ctx):
        if not ctx.is_last_stage:
            return chunk(mb[0])
        out = {"logits": gather(chunk(mb[0]), -1, state)[..., :VOCAB], "per_token": chunk(mb[0], labels=mb[1])}
        if state.pp_size == 1:   # the whole model in this chunk: a second forward at other positions
            out["positioned"] = gather(chunk(mb[0], position_ids=mb[2]), -1, state)[..., :VOCAB]
        return out["per_token"].sum(), out

    micro = [(ids[i:i + 1], labels[i:i + 1], positions[i:i + 1]) for i in range(ids.shape[0])]   # a sequence each
    with torch.no_grad():
        out = forward_backward(step, micro, list(model.chunks), forward_only=True,
                               tensor_shape=(ids.shape[1], 1, hidden),
                               pp_group=state.pp_group if state.pp_size > 1 else None)
    if not out.logged:
        return None
    return {key: torch.cat([logged[key] for logged in out.logged]) for key in out.logged[0]}


def _import_matches(path, layouts, ids, labels, ref_logits, ref_per_token, positions, export_to=None,
                    max_shard_size=None):
    """Import at each layout and compare with Hugging Face; returns (max errors, elements read by rank)."""
    errors, reads = [], []
    for tp, pp, ep, vp, cp in layouts:
        state = ParallelState(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp, ep=ep, cp=cp),
                              virtual_pipeline_size=vp).activate()
        config, kwargs = config_from_hf(path), model_kwargs_from_hf(path)
        model = VirtualChunks(lambda v: LlamaModel(config, vp_rank=v, **kwargs)).eval()
        reads.append(load_hf_llama(model, path))
        split = lambda t: split_for_context_parallel(t, cp, state.cp_rank)   # noqa: E731
        out = _last_stage_outputs(model, state, split(ids), split(labels), config.hidden_size, split(positions[0]))
        if out is not None:
            if "positioned" in out:
                torch.testing.assert_close(out["positioned"], split(positions[1]), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out["logits"], split(ref_logits), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"layout tp{tp} pp{pp} ep{ep} vp{vp} cp{cp}: {m}")
            torch.testing.assert_close(out["per_token"], split(ref_per_token), atol=1e-5, rtol=1e-5)
            errors.append(float((out["logits"] - split(ref_logits)).abs().max()))
    if export_to is not None:
        save_hf_llama(model, export_to, max_shard_size=max_shard_size)
    return errors, reads


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_import_gives_transformers_logits_and_export_loads(families, kind, tmp_path):
    fam = families[kind]
    export = str(tmp_path / "export")
    out = run_on_ranks(_import_matches, 4, fam["path"], LAYOUTS[kind], fam["ids"], fam["labels"],
                       fam["logits"], fam["per_token"], fam["positions"], export, "50KB", timeout=180)
    errors = [e for rank_errors, _ in out for e in rank_errors]
    assert len(errors) >= len(LAYOUTS[kind]) and max(errors) < 1e-5
    total = sum(t.numel() for t in load_hf_state(fam["path"]).values())
    if kind != "mixtral":   # at TP2·PP2 each rank reads about a quarter of the tensors, not the files
        assert all(reads[-1] < 0.35 * total for _, reads in out), ([reads for _, reads in out], total)
    # the export (from the run's last layout) is a directory transformers loads, with the same tensors
    original, written = load_hf_state(fam["path"]), load_hf_state(export)
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    with open(os.path.join(export, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == FAMILIES[kind][1].__name__
    with torch.no_grad():
        again = hf(fam["ids"], labels=fam["ids"])
    torch.testing.assert_close(again.logits, fam["logits"], atol=1e-6, rtol=1e-6)
    assert float(again.loss) == pytest.approx(fam["loss"], rel=1e-6)


def load_hf_state(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for file in files:
        out.update(load_file(os.path.join(path, file)))
    return out


# -- configuration and rotary frequencies (no processes) ------------------------------------------------


@pytest.mark.parametrize("rope", [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),
    dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768),
    dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=4096, beta_fast=16,
         beta_slow=2, mscale=0.707, mscale_all_dim=1.0, truncate=False),
    dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=2048,
         attention_factor=1.25),
])
def test_rope_frequencies_are_transformers_bit_for_bit(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(rope))
    config = config_from_hf(hf_config)
    ours = rope_inverse_frequencies(config.rotary_dim, config.rotary_base, config.rope_scaling)
    if rope["rope_type"] == "default":
        theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
            hf_config)[0]
    else:
        theirs, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
        assert rope_attention_factor(config.rope_scaling) == factor
    assert torch.equal(ours, theirs)


def test_config_from_hf(families):
    for kind, fam in families.items():
        with open(os.path.join(fam["path"], "config.json")) as f:
            hf = json.load(f)
        config = config_from_hf(hf)
        assert config.position_embedding_type == "rope" and not config.add_bias_linear
        assert config.query_groups == hf["num_key_value_heads"]
    assert config_from_hf(families["mistral"]["path"]).head_dim == 32
    assert model_kwargs_from_hf(families["mistral"]["path"])["tie_word_embeddings"] is True
    assert config_from_hf(families["mixtral"]["path"]).moe.num_experts == 4
    qwen_moe = json.load(open(os.path.join(families["qwen3_moe"]["path"], "config.json")))
    moe = config_from_hf(qwen_moe).moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.pre_softmax) == (4, 2, 48, True)
    assert config_from_hf(dict(qwen_moe, norm_topk_prob=True)).moe.pre_softmax is False   # = Mixtral's routing
    with pytest.raises(ValueError, match=r"decoder_sparse_step=2 / mlp_only_layers=\[\] in config.json"):
        config_from_hf(dict(qwen_moe, decoder_sparse_step=2))
    gemma = config_from_hf(families["gemma"]["path"])
    assert (gemma.activation, gemma.layernorm_zero_centered_gamma, gemma.embedding_multiplier) == ("geglu", True, 8.0)
    assert model_kwargs_from_hf(families["gemma"]["path"])["tie_word_embeddings"] is True
    legacy = dict(json.load(open(os.path.join(families["gemma"]["path"], "config.json"))), hidden_act="gelu")
    assert config_from_hf(legacy).activation == "geglu"   # transformers reads the releases' "gelu" as tanh too
    phi3 = json.load(open(os.path.join(families["phi3_longrope"]["path"], "config.json")))
    longrope = config_from_hf(phi3).rope_scaling
    assert longrope["rope_type"] == "longrope" and longrope["factor"] == 64 / 12
    su = dict(phi3, rope_parameters=None, rope_scaling={"type": "su", **{
        k: phi3["rope_parameters"][k] for k in ("short_factor", "long_factor")}})   # the first releases' form
    assert config_from_hf(su).rope_scaling == longrope
    with pytest.raises(ValueError, match="hidden_act='relu' in config.json is not supported for Gemma"):
        config_from_hf(dict(legacy, hidden_act="relu"))


def test_errors_name_the_field():
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.transformer.config import check_query_groups

    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by num_query_groups=3"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=3)
    with pytest.raises(ValueError, match=r"rope_scaling\['rope_type'\]='mrope' is not supported"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, position_embedding_type="rope",
                          rope_scaling={"rope_type": "mrope", "factor": 2.0})
    from lightning_megatron.transformer.rotary import RotaryEmbedding

    with pytest.raises(ValueError, match="'longrope' needs short_factor and long_factor of 2 entries"):
        RotaryEmbedding(4, scaling=dict(rope_type="longrope", factor=2.0, short_factor=[1.0] * 3, long_factor=[1.0] * 3,
                                        original_max_position_embeddings=8))
    run_on_ranks(_dynamic_rope_within_and_beyond_the_original_context, 1, timeout=60)
    with pytest.raises(ValueError, match=r"rope_type 'yarn' needs .*missing \['original_max_position_embeddings'\]"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, position_embedding_type="rope",
                          rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"needs \['factor', 'low_freq_factor'.*missing \['high_freq_factor'"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="position_embedding_type='alibi' is not one of"):
        TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, position_embedding_type="alibi")
    config = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=3)
    with pytest.raises(ValueError, match="num_query_groups=3 and tensor_model_parallel_size=2: one must divide"):
        check_query_groups(config, 2)
    check_query_groups(config, 6)   # each key/value head shared by 2 ranks
    with pytest.raises(ValueError, match="hidden_act='gelu' in config.json is not supported"):
        config_from_hf(dict(model_type="llama", hidden_act="gelu"))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(123) == 123


def _dynamic_rope_within_and_beyond_the_original_context():
    from lightning_megatron.transformer.rotary import RotaryEmbedding

    ParallelState(ParallelLayout(1)).activate()
    dynamic = RotaryEmbedding(4, scaling=dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=8))
    cos, _ = dynamic(8, torch.device("cpu"), torch.float32)   # within the original context: the default angles
    torch.testing.assert_close(cos, RotaryEmbedding(4)(8, torch.device("cpu"), torch.float32)[0])
    with pytest.raises(ValueError, match="sequence length 9 exceeds rope_scaling 'dynamic''s"):
        dynamic(9, torch.device("cpu"), torch.float32)


def test_partial_rotary_rotates_the_first_channels_only():
    from lightning_megatron.transformer.rotary import apply_rotary, rotate_half

    x = torch.randn(2, 3, 5, 8)
    inv_freq = rope_inverse_frequencies(4, 100.0)
    angles = torch.arange(5)[:, None].float() * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], x[..., :4] * cos + rotate_half(x[..., :4]) * sin)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)   # a rotation


def _one_sgd_step_like_transformers(path, ids, labels, export_to):
    """One SGD step of the imported model and of transformers' own on the same batch; our updated weights, exported,
    must equal transformers' updated ones (every gradient, q/k/v biases included, went the same way)."""
    from lightning_megatron.models.hf_llama import llama_from_hf

    ParallelState(ParallelLayout(1)).activate()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).float().train()
    ours = llama_from_hf(path).train()
    hf(ids, labels=ids).loss.backward()
    per_token = ours(ids, labels=labels)
    (per_token.sum() / (labels != -100).sum()).backward()
    for model in (hf, ours):
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    save_hf_llama(ours, export_to)
    return {name: (tensor, load_hf_state(export_to)[name]) for name, tensor in hf.state_dict().items()
            if name != "lm_head.weight" or not hf.config.tie_word_embeddings}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "olmo2", "olmo3"])
def test_one_training_step_equals_transformers(families, kind, tmp_path):
    fam = families[kind]
    pairs = run_on_ranks(_one_sgd_step_like_transformers, 1, fam["path"], fam["ids"], fam["labels"],
                         str(tmp_path / "after"), timeout=120)[0]
    original = load_hf_state(fam["path"])
    moved = 0
    for name, (theirs, ours) in pairs.items():
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        moved += not torch.equal(theirs, original[name])
    assert moved == len(pairs)   # every tensor took a step (lr 1: a gradient left out would show)


def test_moe_imports_choose_transformers_balancing_loss():
    """output_router_logits=true: transformers' loss pooled over layers at router_aux_loss_coef; false: none (as
    transformers adds none); a MoEConfig passed explicitly wins."""
    from lightning_megatron.moe import MoEConfig

    hf = dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
    moe = config_from_hf(hf).moe
    assert (moe.aux_loss_coeff, moe.aux_loss_type) == (0.02, "hf_pooled")
    assert config_from_hf(dict(hf, output_router_logits=False)).moe.aux_loss_coeff == 0.0
    chosen = MoEConfig(hidden_size=64, ffn_hidden_size=96, num_experts=4, topk=2, aux_loss_coeff=0.01)
    assert config_from_hf(hf, moe=chosen).moe.aux_loss_type == "per_layer"


def test_multimodal_gemma3_imports_its_language_model(tmp_path):
    """A Gemma 3 checkpoint with a vision tower (Gemma3ForConditionalGeneration: the 4B-27B releases): its language
    model (tensors ``language_model.*``, config ``text_config``) imports alone and equals transformers on text at
    tp1 and tp2; the export is that language model, a Gemma3ForCausalLM with the same logits."""
    text = dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, sliding_window=6,
                query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    path, export = str(tmp_path / "mm"), str(tmp_path / "export")
    model.save_pretrained(path, max_shard_size="60KB")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 4, (BATCH, SEQ), generator=gen)   # text only: no image tokens
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    positions = (torch.arange(SEQ) % (SEQ // 2 + 3)).expand(BATCH, SEQ)
    with torch.no_grad():   # the wrapper masks by explicit positions as packed documents: its text model alone here
        logits = model(ids).logits
        positioned = model.lm_head(model.model.language_model(ids, position_ids=positions).last_hidden_state)
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    out = run_on_ranks(_import_matches, 2, path, [(1, 1, 1, None, 1), (2, 1, 1, None, 1)], ids, labels, logits,
                       per_token, (positions, positioned), export, "5MB", timeout=120)
    assert max(e for rank_errors, _ in out for e in rank_errors) < 1e-5
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, logits, atol=1e-6, rtol=1e-6)


def _pooled_loss_with_padding():
    ParallelState(ParallelLayout(1)).activate()
    hf = dict(model_type="mixtral", num_hidden_layers=1, hidden_size=16, intermediate_size=24, num_attention_heads=4,
              num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
              vocab_size=VOCAB)
    model = LlamaModel(config_from_hf(hf), **model_kwargs_from_hf(hf))
    ids, mask = torch.randint(0, VOCAB, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask under aux_loss_type='hf_pooled'"):
        model.train()(ids, attention_mask=mask, labels=ids)
    model.eval()(ids, attention_mask=mask)   # no loss to take padding into: allowed


def test_pooled_balancing_loss_refuses_padding_masks():
    """transformers leaves masked tokens out of its balancing loss; the routers see no mask, so training with one
    is refused rather than counting the padding."""
    run_on_ranks(_pooled_loss_with_padding, 1, timeout=60)


def _phi3_grouped(path, ids, ref_logits, export_to):
    ParallelState(ParallelLayout(dist.get_world_size(), tp=dist.get_world_size())).activate()
    from lightning_megatron.models.hf_llama import llama_from_hf

    model = llama_from_hf(path).eval()
    with torch.no_grad():
        logits = gather(model(ids), -1, get_state())[..., :VOCAB]
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="phi3' export needs .* as many key/value heads as query heads"):
        save_hf_llama(model, export_to)
    return True


def get_state():
    from lightning_megatron.parallel import get_parallel_state

    return get_parallel_state()


def test_phi3_with_grouped_query_attention_imports_and_refuses_its_export(tmp_path):
    """Phi-3-medium's shape: 4 query heads over 2 key/value heads in the fused qkv_proj; at tp2 each rank slices its
    query rows and its group's key and value rows out of the one tensor."""
    torch.manual_seed(2)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2,
                                                             pad_token_id=0)).eval()
    hf.save_pretrained(str(tmp_path / "phi3"))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert run_on_ranks(_phi3_grouped, 2, str(tmp_path / "phi3"), ids, ref, str(tmp_path / "out"), timeout=120) == \
        [True, True]
