"""``calculate_per_token_loss``: the loss is the mean over the global batch's labelled tokens, exactly one
process's, however they spread over micro-batches, data-parallel and context-parallel ranks.

The data are packed rows whose padding has no label, so rows, micro-batches and sequence halves hold
different numbers of labelled tokens: averaging per-rank means (the default) is then *not* one process's
mean, which ``test_mean_losses_differ_from_one_process_there`` shows for the same runs (so the equivalence
tests can see a wrong weighting). With MoE, every micro-batch's balancing loss weighs its tokens (as in
Megatron-Core); when every token has a label that equals the mean-loss weighting, so the per-token runs
are compared with the ordinary one-process Mixtral run.

Tolerance: sums divided once round differently from means (up to 2.4e-6 apart after three lr-2 steps);
the wrong weighting moves parameters by 0.2 (dp2-mb2) and 0.7 (cp2).
"""

import pytest
import torch

from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import PackedTokenData, assert_same_updates, fit_and_record, fit_tiny_gpt
from test_llama_strategy import PackedLlama, TinyMixtral
from test_llama_strategy import mixtral_reference  # noqa: F401  (the fixture: mean losses, one sample per micro-batch)


class PaddingUnlabelledLlama(PackedLlama):
    """Loss over the tokens inside a document only; ``per_token``: returns their sum and count."""

    per_token = True

    def training_step(self, batch, batch_idx):
        counted = (batch["document_ids"] >= 0).float()
        total, count = (self(batch) * counted).sum(), counted.sum()
        self.log("train_loss", total / count, sync_dist=True)
        return {"loss": total, "num_tokens": count} if self.per_token else total / count

    def on_train_batch_end(self, outputs, batch, batch_idx):
        """``probe``: the step's global token count (one process: counted on its whole batch)."""
        super().on_train_batch_end(outputs, batch, batch_idx)
        count = outputs["num_tokens"] if self.per_token else (batch["document_ids"] >= 0).sum()
        self.sums = getattr(self, "sums", []) + [float(count)]


class MeanLossLlama(PaddingUnlabelledLlama):
    per_token = False


class PerTokenMixtral(TinyMixtral):
    """Every token labelled; the sum and an int count returned, the balancing losses logged."""

    def training_step(self, batch, batch_idx):
        from lightning_megatron.moe import collect_aux_losses
        from lightning_megatron.parallel import get_parallel_state

        losses = self(batch)
        self.log("train_loss", losses.mean(), sync_dist=True)
        for name, value in collect_aux_losses(self, group=get_parallel_state().group("tp-cp")).items():
            self.log(name, value, sync_dist=True)
        return {"loss": losses.sum(), "num_tokens": losses.numel()}


PER_TOKEN = {   # name: (world, strategy arguments); 8 samples per step
    "dp2-mb2": (2, dict(micro_batch_size=2)),                                     # plain .grad
    "dp2-mb2-distopt": (2, dict(micro_batch_size=2, use_distributed_optimizer=True)),   # sharded buffers
    "pp2vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                        micro_batch_size=2)),
    "cp2": (2, dict(context_parallel_size=2)),
    "tp2sp-fp32-buffers": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=4,
                                   grad_reduce_in_fp32=True)),
    # the sums and counts come out of a whole-step graph (its bookkeeping, without CUDA)
    "dp2-mb2-full-graph": (2, dict(micro_batch_size=2, cuda_graph="full", cuda_graph_backend="eager")),
}
PER_TOKEN_MOE = {
    "ep2": (2, dict(expert_model_parallel_size=2)),   # dp2 for the dense weights
    "cp2": (2, dict(context_parallel_size=2)),
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def one_process():
    """The whole batch at once, the plain mean over its labelled tokens."""
    return run_on_ranks(fit_and_record, 1, dict(), module_cls=MeanLossLlama, dataset=PackedTokenData(),
                        timeout=120)[0]


@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_per_token_loss_matches_one_process(one_process, name):
    world, kwargs = PER_TOKEN[name]
    out = run_on_ranks(fit_and_record, world, dict(calculate_per_token_loss=True, **kwargs),
                       module_cls=PaddingUnlabelledLlama, dataset=PackedTokenData(), timeout=240)
    assert_same_updates(out[0]["params"], one_process["params"], rtol=1e-4, atol=1e-5)
    for rank_out in out:   # what Lightning reports as the step's loss: the global token mean
        assert rank_out["losses"] == pytest.approx(one_process["losses"], rel=1e-5, abs=1e-6)
        assert rank_out["probe"] == one_process["probe"]   # outputs["num_tokens"]: the global batch's count


@pytest.mark.parametrize("name", ["dp2-mb2", "cp2"])
def test_mean_losses_differ_from_one_process_there(one_process, name):
    """Without the option the same runs average per-micro-batch, per-rank means: not one process's step."""
    world, kwargs = PER_TOKEN[name]
    out = run_on_ranks(fit_and_record, world, kwargs, module_cls=MeanLossLlama, dataset=PackedTokenData(),
                       timeout=240)
    with pytest.raises(AssertionError):
        assert_same_updates(out[0]["params"], one_process["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(PER_TOKEN_MOE))
def test_per_token_moe_weighs_balancing_losses_by_tokens(mixtral_reference, name):
    world, kwargs = PER_TOKEN_MOE[name]
    out = run_on_ranks(fit_and_record, world, dict(micro_batch_size=1, calculate_per_token_loss=True, **kwargs),
                       module_cls=PerTokenMixtral, timeout=240)
    assert_same_updates(out[0]["params"], mixtral_reference["params"], rtol=1e-4, atol=1e-5)
    assert "load_balancing_loss" in out[0]["logged"]
    for rank_out in out:
        assert rank_out["losses"] == pytest.approx(mixtral_reference["losses"], rel=1e-5, abs=1e-6)


def _error(strategy_kwargs, module_cls, trainer_kwargs=None):
    try:
        fit_tiny_gpt(strategy_kwargs, max_steps=1, module_cls=module_cls, dataset=PackedTokenData(),
                     trainer_kwargs=trainer_kwargs)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def test_per_token_loss_without_a_token_count_names_the_option():
    error = run_on_ranks(_error, 1, dict(calculate_per_token_loss=True), MeanLossLlama, timeout=120)[0]
    assert error is not None and error.startswith("TypeError") and "calculate_per_token_loss" in error \
        and "num_tokens" in error


def test_per_token_loss_refuses_lightning_accumulation():
    errors = run_on_ranks(_error, 2, dict(calculate_per_token_loss=True), PaddingUnlabelledLlama,
                          dict(accumulate_grad_batches=2), timeout=120)
    assert len(set(errors)) == 1   # the same error on every rank, before any step
    assert "accumulate_grad_batches=2" in errors[0] and "micro_batch_size" in errors[0]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [dict(cuda_graph="partial", cuda_graph_scope=["mlp"]), dict(cuda_graph="full")],
                         ids=["partial-mlp", "full"])
def test_gpu_per_token_loss_under_cuda_graphs_trains_like_eager(graphs):
    """On one GPU through the Trainer: the token sums and counts replayed from graphs give eager's updates
    (per-layer graphs of the MLPs only: packed rows' positions refuse attention graphs by name)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    kwargs = dict(calculate_per_token_loss=True, micro_batch_size=2)
    options = dict(module_cls=PaddingUnlabelledLlama, module_kwargs=dict(document_attention="mask"),
                   dataset=PackedTokenData(), accelerator="gpu", max_steps=4, backend="nccl", timeout=300)
    eager = run_on_ranks(fit_and_record, 1, kwargs, **options)[0]
    graphed = run_on_ranks(fit_and_record, 1, dict(graphs, **kwargs), **options)[0]
    assert_same_updates(graphed["params"], eager["params"], rtol=1e-4, atol=1e-5)
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-6)
