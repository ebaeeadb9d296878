"""Dense families whose layers differ most from Llama's (Gemma 2: norms around each sub-block, soft-capped and
scaled attention, soft-capped logits, windows on alternate layers; OLMo-2: norms on the sub-blocks' outputs and
query/key norms over all heads, their statistics summed over tp; Gemma 3: per-head query/key norms and the windowed
layers' own rotary base), imported from Hugging Face inside ``configure_model``: one AdamW step through the Trainer
at a parallel layout gives transformers' loss, and the export after it holds transformers' updated weights.

The weights are random at 10x transformers' initial scale where the soft-caps need it to bend anything, and every
norm weight is random, so a norm read into the wrong place, or a gradient summed wrongly over tp, shows.
"""

import pytest
import torch
import transformers

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import fit_tiny_gpt
from test_hf_moe_balancing import OPTIMIZER, Export, ImportedMoE, Rows, hf_state, hf_step

VOCAB, SEQ, BATCH = 100, 16, 2
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=VOCAB,
              max_position_embeddings=64, num_key_value_heads=2, pad_token_id=0)
CASES = {   # family, layout (world size, strategy options)
    "gemma2-tp2sp": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                     dict(num_hidden_layers=2, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
                          attn_logit_softcapping=5.0, final_logit_softcapping=4.0, initializer_range=0.2),
                     (2, dict(tensor_model_parallel_size=2, sequence_parallel=True))),
    "olmo2-tp2sp": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(num_hidden_layers=2),
                    (2, dict(tensor_model_parallel_size=2, sequence_parallel=True))),
    "gemma3-pp2": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                   dict(num_hidden_layers=2, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention"]),
                   (2, dict(pipeline_model_parallel_size=2))),
}


class ImportedDense(ImportedMoE):
    """The imported model's mean token loss, logged as ``ce``."""

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum() / (batch["labels"] != -100).sum()
        self.log("ce", loss, sync_dist=True)
        return loss


def tiny_hf(case, path):
    config_cls, model_cls, extra, _ = CASES[case]
    torch.manual_seed(1)
    model = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):   # Gemma's scale by 1 + weight: 0 is the identity there
                param.normal_(0.0 if case.startswith("gemma") else 1.0, 0.5)
    model.save_pretrained(path)
    return model


def _train_and_export(strategy_kwargs, path, ids, out):
    return fit_tiny_gpt(strategy_kwargs, global_batch_size=BATCH, max_steps=1, module_cls=ImportedDense,
                        module_kwargs=dict(path=path), dataset=Rows(ids),
                        trainer_kwargs=dict(callbacks=[Export(out)]))["logged"]


@pytest.mark.parametrize("case", list(CASES))
def test_one_trainer_step_equals_transformers(case, tmp_path):
    world, strategy_kwargs = CASES[case][3]
    path, out = str(tmp_path / "hf"), str(tmp_path / "after")
    model = tiny_hf(case, path)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    logged = run_on_ranks(_train_and_export, world, strategy_kwargs, path, ids, out, timeout=240)[0]
    assert logged["ce"] == pytest.approx(hf_step(model, ids, 1), abs=1e-5)
    model.save_pretrained(str(tmp_path / "theirs"))
    theirs, ours = hf_state(str(tmp_path / "theirs")), hf_state(out)
    assert ours.keys() == theirs.keys()
    moved = [name for name in theirs if not torch.equal(theirs[name], hf_state(path)[name])]
    assert len(moved) == len(theirs)   # every tensor took the step
    worst = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    print(f"{case}: max |Δparam| after one AdamW step = {worst:.2e}")
    assert worst < 1e-5
