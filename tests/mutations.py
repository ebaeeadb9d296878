"""Plant the bugs we fear in a copy of the package and check that a named test fails for each.

Each mutation is one textual change of one source file (it must match exactly once) and the tests
that must catch it. The copy lives in a temporary folder run as the current directory, so the
mutated package is the one imported (by pytest and by every rank the harness starts) and the
working tree is never touched.

    python tests/mutations.py            # every mutation, then the table
    python tests/mutations.py --list
    python tests/mutations.py buffers-divisor-without-cp tied-embedding-plain
    python tests/mutations.py --ci --json   # the CI ones; verdicts as JSON (tests/meta/test_mutations.py)

Many mutations run from one warm process (``run_warm``: torch and Lightning imported once, a forked child
per mutation, two at a time); ``run`` runs one in a fresh interpreter.

``tests/meta/test_mutations.py`` runs them under pytest (CI).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
STRATEGY = "tests/integration/strategy"   # the Trainer tests that catch most mutations
UPDATES = f"{STRATEGY}/test_strategy_updates.py::test_dense_updates_match_single_process"
MOE_UPDATES = f"{STRATEGY}/test_strategy_updates.py::test_moe_updates_with_balancing_losses_match_single_process"
PACKED = "tests/unit/transformer/test_packed_attention.py"
PER_TOKEN = f"{STRATEGY}/test_per_token_loss.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str       # source file, relative to the repository root
    old: str        # text that occurs exactly once in it
    new: str
    tests: Tuple[str, ...]   # pytest node ids; at least one must fail
    ci: bool = True          # run by tests/meta/test_mutations.py (CI); the others by this script only


FINALIZE = "lightning_megatron/distributed/finalize.py"
GRADIENTS = "lightning_megatron/distributed/gradients.py"
BUFFER_DIVISOR = "divisor=dp_cp"

MUTATIONS: List[Mutation] = [
    # plain .grad finalize
    Mutation("plain-divisor-without-cp", FINALIZE, 'divisor = state.size("dp-cp")', 'divisor = state.size("dp")',
             (f"{UPDATES}[cp2]",)),
    Mutation("plain-divisor-with-tp", FINALIZE, 'divisor = state.size("dp-cp")', 'divisor = state.size("tp-dp-cp")',
             (f"{UPDATES}[tp2]",)),
    Mutation("plain-no-sequence-parallel-reduce", FINALIZE,
             "        allreduce_sequence_parallel_grads(params, state.tp_group)\n", "        pass\n",
             (f"{UPDATES}[tp2sp]",), ci=False),
    Mutation("plain-no-tied-embedding-reduce", FINALIZE,
             "        allreduce_shared_embedding_grads(modules)  # middle stages return at once\n", "        pass\n",
             (f"{UPDATES}[pp2]",)),
    Mutation("plain-expert-divisor-is-edp-size", FINALIZE,
             "_all_reduce_coalesced(bucket, state.group(name), divisor=divisor)",
             "_all_reduce_coalesced(bucket, state.group(name), divisor=state.size(name))",
             (f"{MOE_UPDATES}[tp2etp1]",), ci=False),
    Mutation("plain-expert-alone-not-divided", FINALIZE, "                grad.div_(divisor)\n",
             "                pass\n", (f"{MOE_UPDATES}[ep2]",)),
    # gradient buffers, overlapped reduction and the distributed optimizer share the buffers' divisor:
    # each path's own test must catch it
    *[Mutation(f"{path}-divisor-without-cp", GRADIENTS, BUFFER_DIVISOR, 'divisor=state.size("dp")',
               (f"{UPDATES}[dp2cp2-{path}]",)) for path in ("buffers", "overlap", "distopt")],
    *[Mutation(f"{path}-divisor-with-tp", GRADIENTS, BUFFER_DIVISOR, 'divisor=state.size("tp-dp-cp")',
               (f"{UPDATES}[dp2tp2sp-{path}]",)) for path in ("buffers", "overlap", "distopt")],
    Mutation("buffers-no-sequence-parallel-reduce", FINALIZE, "            if partial:\n",
             "            if False:\n", (f"{UPDATES}[dp2tp2sp-buffers]",), ci=False),
    Mutation("buffers-no-tied-embedding-reduce", FINALIZE,
             "embedding = (lambda: allreduce_shared_embedding_grads(modules)) if state.pp_size > 1 else None",
             "embedding = None", (f"{UPDATES}[dp2pp2-buffers]",)),
    Mutation("distopt-divides-rank0-shard-only", "lightning_megatron/distributed/grad_buffer.py",
             "            lo, hi = self.shard_range(bucket)\n            self.data[lo:hi].div_(self.divisor)",
             "            lo, hi = self.shard_range(bucket, rank=0)\n            self.data[lo:hi].div_(self.divisor)",
             (f"{UPDATES}[dp4-distopt]",), ci=False),
    Mutation("expert-buffers-over-dense-group", "lightning_megatron/distributed/data_parallel.py",
             "expert_group if expert else dense_group", "dense_group",
             (f"{MOE_UPDATES}[dp4ep2-buffers]",), ci=False),
    # MoE balancing losses and exact resume
    Mutation("aux-loss-scale-off-by-cp", "lightning_megatron/engine/step.py",
             "aux_loss_scale * state.cp_size / len(microbatches)", "aux_loss_scale / len(microbatches)",
             (f"{MOE_UPDATES}[cp2]",)),
    Mutation("rng-restored-before-the-iterator", "lightning_megatron/adapter/resumable_loader.py", "        if skip:\n",
             "        if False:\n",
             (f"{STRATEGY}/test_strategy_features.py::test_resume_with_dropout_draws_the_same_masks",)),
    # packed documents: attention stays within each document on every layout, and the recipe passes the ids
    Mutation("attention-ignores-document-ids", "lightning_megatron/transformer/attention.py",
             "documents = None if document_ids is None else DocumentMask.of(document_ids)", "documents = None",
             (f"{PACKED}::test_packed_rows_equal_each_document_alone",), ci=False),
    Mutation("context-parallel-keys-without-their-document-ids", "lightning_megatron/transformer/context_parallel.py",
             "lambda ids: all_gather_context_parallel(ids, seq_dim=1, group=group)", "lambda ids: ids.repeat(1, cp)",
             (f"{STRATEGY}/test_llama_strategy.py::test_packed_llama_updates_match_single_process[packed-cp2]",), ci=False),
    Mutation("recipe-drops-document-ids", "lightning_megatron/recipes/pretrain/llama.py",
             'labels=batch["labels"],\n                          document_ids=batch.get("document_ids"))',
             'labels=batch["labels"])', (f"{PACKED}::test_recipe_passes_document_ids_from_packed_data",), ci=False),
    # per-token losses: divided once by the global token count; balancing losses weighed by their tokens
    Mutation("per-token-grads-not-divided-by-tokens", "lightning_megatron/engine/train_step.py",
             "                gradients.scale(result.grad_scale)\n", "                pass\n",
             (f"{PER_TOKEN}::test_per_token_loss_matches_one_process[dp2-mb2]",)),
    Mutation("per-token-counts-averaged-over-dp", "lightning_megatron/engine/step.py",
             "                if not self.per_token:\n                    loss /= dp_cp", "                loss /= dp_cp",
             (f"{PER_TOKEN}::test_per_token_loss_matches_one_process[dp2-mb2-distopt]",), ci=False),
    Mutation("per-token-aux-not-weighted-by-tokens", "lightning_megatron/moe/router.py",
             "        if not self.aux_loss_per_token:\n", "        if True:\n",
             (f"{PER_TOKEN}::test_per_token_moe_weighs_balancing_losses_by_tokens[ep2]",)),
    Mutation("per-token-aux-times-cp", "lightning_megatron/engine/step.py",
             "set_aux_loss_scale(self.routers, aux_loss_scale, per_token=True)",
             "set_aux_loss_scale(self.routers, aux_loss_scale * state.cp_size, per_token=True)",
             (f"{PER_TOKEN}::test_per_token_moe_weighs_balancing_losses_by_tokens[cp2]",), ci=False),
    # bf16-true: the step is a plain PyTorch loop's, bit for bit
    Mutation("bf16-grad-buffers-float32-unasked", "lightning_megatron/distributed/data_parallel.py",
             "grad_dtype = torch.float32 if grad_reduce_in_fp32 and dtype in",
             "grad_dtype = torch.float32 if dtype in",
             (f"{STRATEGY}/test_bf16_exact.py::test_bf16_true_steps_are_the_plain_loop_bit_for_bit[grad-buffers]",)),
    Mutation("bf16-clip-coefficient-float32", "lightning_megatron/distributed/clip.py",
             "torch._foreach_mul_(same, factor.to(device=grad_device, dtype=dtype))",
             "torch._foreach_mul_(same, factor.to(device=grad_device))",
             (f"{STRATEGY}/test_bf16_exact.py::test_bf16_true_steps_are_the_plain_loop_bit_for_bit[one-micro-batch]",)),
    # data: a user's DistributedSampler by global rank would feed tensor-parallel peers different samples
    Mutation("sampler-by-global-rank-accepted", "lightning_megatron/adapter/sampler_check.py",
             "sampler.num_replicas != num_replicas or sampler.rank != rank",
             "sampler.num_replicas < 0",
             (f"{STRATEGY}/test_sampler_check.py::test_a_sampler_by_global_rank_is_refused_on_every_rank[tp2]",)),
    # what a user's configure_optimizers and optimization style meet
    Mutation("tied-embedding-settings-unchecked", "lightning_megatron/pipeline/shared_embeddings.py",
             "    if message is not None:\n        raise ValueError(message)\n", "",
             (f"{STRATEGY}/test_user_optimizers.py::test_tied_embedding_split_over_parameter_groups_is_refused_on_every_rank",)),
    Mutation("manual-optimization-accepted", "lightning_megatron/adapter/last_stage.py",
             "    if not module.automatic_optimization:", "    if False:",
             (f"{STRATEGY}/test_user_optimizers.py::test_manual_optimization_is_refused_on_every_rank",), ci=False),
    Mutation("grad-norm-of-this-rank-shard", GRADIENTS,
             "        return global_grad_norm(params, self.state, norm_type, sharded=self.sharded,",
             "        return global_grad_norm(params, self.state, norm_type, sharded=False,",
             (f"{STRATEGY}/test_user_optimizers.py::test_grad_norm_is_one_process_norm_on_every_rank_and_edits_reach_the_update[dp2-distopt]",),
             ci=False),
    # what training_step logs, over micro-batches and stages
    Mutation("logs-averaged-whatever-reduce-fx", "lightning_megatron/adapter/log_capture.py",
             "                records[name] = (_as_value(name, value), reduce_op(args, kwargs))\n",
             "                records[name] = (_as_value(name, value), \"mean\")\n",
             (f"{STRATEGY}/test_user_logging.py::test_logged_sums_maxima_and_minima_are_one_process_values[pp2]",)),
    Mutation("log-error-raised-on-the-last-stage-only", "lightning_megatron/adapter/log_capture.py",
             "                self.error = self.error or (type(err).__name__, str(err))\n", "                raise\n",
             (f"{STRATEGY}/test_user_logging.py::test_a_value_that_cannot_be_logged_is_raised_on_every_rank[pp4]",),
             ci=False),
    Mutation("metric-states-not-sent-to-other-stages", "lightning_megatron/adapter/metric_sync.py",
             "    if not changes:\n        return\n", "    return\n",
             (f"{STRATEGY}/test_user_logging.py::test_metric_objects_under_pipeline_parallelism_give_one_process_epoch_values[pp2]",)),
    Mutation("metric-reset-seen-by-update-count-only", "lightning_megatron/adapter/metric_sync.py",
             "                changed |= sent_tensors.get(name) is not value\n", "",
             (f"{STRATEGY}/test_user_logging.py::test_metric_objects_under_pipeline_parallelism_give_one_process_epoch_values[pp2]",),
             ci=False),
    Mutation("training-outputs-loss-only", "lightning_megatron/adapter/last_stage.py",
             "    outputs = dict(extras or {}, loss=result.loss)", "    outputs = dict(loss=result.loss)",
             (f"{STRATEGY}/test_user_logging.py::test_training_step_outputs_besides_the_loss_reach_on_train_batch_end[pp2]",),
             ci=False),
    Mutation("rebuilding-configure-model-accepted", "lightning_megatron/adapter/last_stage.py",
             "    if before and before - {id(p) for p in module.parameters()}:", "    if False:",
             (f"{STRATEGY}/test_strategy_features.py::test_validate_after_fit_evaluates_the_trained_model_and_a_rebuilding_configure_model_is_refused[pp2]",),
             ci=False),
    Mutation("resume-skips-in-any-epoch", "lightning_megatron/adapter/resumable_loader.py",
             "        if key is not None and resume.get(\"epoch\") == key:", "        if True:",
             (f"{STRATEGY}/test_resume_data.py::test_a_sequential_loader_resumes_exactly_mid_epoch_and_at_an_epoch_end",),
             ci=False),
    Mutation("cp-logs-not-combined", "lightning_megatron/engine/step.py",
             "        if state.cp_size > 1:   # each cp rank logged", "        if False:   # each cp rank logged",
             (f"{STRATEGY}/test_user_logging.py::test_values_logged_from_shares_of_the_sequences_are_one_process_values[cp2]",)),
    Mutation("cp-splits-every-2d-tensor", "lightning_megatron/engine/step.py",
             "keys=sequence_keys(batch))", "keys=None)",
             (f"{STRATEGY}/test_user_logging.py::test_values_logged_from_shares_of_the_sequences_are_one_process_values[cp2]",),
             ci=False),
    # the step protocol: what a plain loop must not miss, what must not outlive a step
    Mutation("received-activation-kept-by-other-chunks", "lightning_megatron/engine/step.py",
             "            for chunk in range(self.chunks):\n", "            for chunk in range(1):\n",
             ("tests/unit/engine/test_engine.py::test_no_received_activation_outlives_its_step[2]",), ci=False),
    Mutation("expert-biases-not-registered", "lightning_megatron/engine/train_step.py",
             "        if routers:   # aux-loss-free balancing", "        if False:   # aux-loss-free balancing",
             ("tests/unit/engine/test_engine.py::test_moe_expert_biases_update_in_a_plain_loop_exactly_as_through_the_trainer[1-strategy_kwargs0-layout0]",),
             ci=False),
    # clipping by value: every gradient element, wherever the optimizer holds it
    Mutation("clip-by-value-skipped", "lightning_megatron/adapter/precision.py",
             "        torch.nn.utils.clip_grad_value_(params, clip_val)   # elementwise: no communication needed\n",
             "        pass\n",
             (f"{STRATEGY}/test_strategy_updates.py::test_value_clipping_matches_single_process[dp4-distopt]",), ci=False),
    # clipping by the whole model's norm
    Mutation("clip-norm-counts-tp-duplicates", "lightning_megatron/distributed/clip.py",
             "    if not param_is_not_tensor_parallel_duplicate(param, state.tp_rank):\n        return False\n", "",
             (f"{STRATEGY}/test_strategy.py::test_losses_match_single_process_with_clipping[tp2]",), ci=False),
    # 16-mixed: every pipeline/tensor shard must skip the step another shard's overflow skips
    Mutation("scaler-overflow-not-agreed", "lightning_megatron/adapter/precision.py",
             "                dist.all_reduce(found, op=dist.ReduceOp.MAX)\n", "                pass\n",
             (f"{STRATEGY}/test_precision.py::test_16_mixed_under_pipeline_parallelism_skips_the_step_on_every_stage",)),
    # evaluation: a ragged last batch's smaller micro-batch weighs what it holds
    Mutation("eval-microbatch-logs-unweighted", "lightning_megatron/engine/logs.py",
             "            value = values.mean() if len(set(used)) == 1 else", "            value = values.mean() if True else",
             (f"{STRATEGY}/test_strategy_features.py::test_ragged_last_validation_batch_counts_every_sample",), ci=False),
    # throughput: samples counted once per data-parallel replica, FLOPs once for the whole model
    Mutation("throughput-counts-per-rank", "lightning_megatron/adapter/callbacks.py",
             "    shared = world / _data_parallel_size(trainer, world)", "    shared = world",
             (f"{STRATEGY}/test_throughput.py::test_two_ranks_count_the_global_batch_and_the_model_once[dp2]",), ci=False),
    Mutation("throughput-counts-every-rank", "lightning_megatron/adapter/callbacks.py",
             "    shared = world / _data_parallel_size(trainer, world)", "    shared = 1",
             (f"{STRATEGY}/test_throughput.py::test_two_ranks_count_the_global_batch_and_the_model_once[tp2]",), ci=False),
    # fused cross-entropy: each tp shard's sum of exponentials is taken at its own max; unscaled to the global
    # max before the sum over tp, the logsumexp is wrong whenever the shards' maxima differ
    Mutation("fused-cross-entropy-sums-unscaled", "lightning_megatron/tensor_parallel/fused_cross_entropy.py",
             "            stats[1] *= torch.exp(stats[0] - global_max)", "            pass  #",
             ("tests/unit/tensor_parallel/test_fused_cross_entropy.py::test_matches_unfused[2]",), ci=False),
    # compiled layers: dropout drawn by inductor's own generator (tp ranks' masks no longer the eager ones)
    Mutation("compiled-dropout-from-inductor-rng", "lightning_megatron/transformer/compile.py",
             'if kwargs.get("backend", "inductor") == "inductor" and _uses_dropout(layer):',
             "if False:", ("tests/unit/transformer/test_compile.py::"
                           "test_inductor_layers_equal_eager_with_dropout_under_tensor_parallel[True]",), ci=False),
    # compile_layers="auto": host-bound layers compiled (BERT-base's step 2.07x a plain loop), or a layer's decision
    # not handed back (the gradient-accumulation fusion setup turned on for compiled code left on in eager layers)
    Mutation("auto-compiles-host-bound-layers", "lightning_megatron/transformer/compile.py",
             "        compiled = auto_compiles(tokens, width)", "        compiled = True",
             ("tests/unit/transformer/test_compile.py::"
              "test_auto_compiles_the_layers_whose_first_call_carries_enough_work",), ci=False),
    Mutation("auto-eager-layers-keep-the-fusion", "lightning_megatron/transformer/compile.py",
             "            self.on_bound(layer)", "            pass",
             ("tests/unit/transformer/test_compile.py::"
              "test_auto_compiles_the_layers_whose_first_call_carries_enough_work",), ci=False),
    # clipping: the expert term skipped whenever its group has nothing to reduce, experts or not
    Mutation("clip-norm-drops-lone-expert-term", "lightning_megatron/distributed/clip.py",
             "        if alone and not grads:", "        if alone and name == \"tp-ep-pp\":",
             ("tests/unit/distributed/test_clip.py::test_expert_gradients_count_when_their_group_is_alone",)),
    # partial graphs ask for baked constants only of the layers that had some at the capture: none asked, a changed
    # constant (MoE loss scale, a user's layer's value) would replay the stale graph
    Mutation("graph-constants-never-asked", "lightning_megatron/cuda_graphs/partial.py",
             "self._constant_layers = [layer for layer in layers if layer.graph_constants()]",
             "self._constant_layers = []",
             ("tests/unit/cuda_graphs/test_cuda_graphs.py::"
              "test_a_users_layer_implementing_the_protocol_is_graphed_and_trains_like_eager",)),
    # cuda_graph_scope="block": a parameter left out of the block's graph gets no gradient from the replay
    Mutation("block-graph-drops-a-layers-parameters", "lightning_megatron/transformer/block.py",
             "self._layers, self._layers, [self.layers],", "self._layers, self._layers, [self.layers[:-1]],",
             ("tests/unit/cuda_graphs/test_cuda_graphs.py::test_graph_bookkeeping_trains_like_eager_on_cpu",)),
    # graphs' parameter gradients delivered by hand (cuda_graphs/runner.py): the data-parallel buffers' hooks never
    # called, a later micro-batch's gradient replacing the earlier ones, tensor hooks run a second time (the old
    # path through autograd), a parameter two graphed pieces share delivered by each
    Mutation("graph-grads-skip-post-accumulate-hooks", "lightning_megatron/cuda_graphs/runner.py",
             "    for param in delivered:\n        run_post_accumulate_grad_hooks(param)",
             "    for param in delivered:\n        pass",
             ("tests/unit/cuda_graphs/test_cuda_graphs.py::test_parameter_gradients_reach_hooks_and_grads_as_autograd_delivers_them",
              f"{UPDATES}[dp2-partial-graphs-distopt-gather]")),
    Mutation("graph-grads-overwrite-accumulated", "lightning_megatron/cuda_graphs/runner.py",
             "        if param.grad is None:\n            new.append(i)",
             "        if True:\n            new.append(i)",
             ("tests/unit/cuda_graphs/test_cuda_graphs.py::test_graph_bookkeeping_trains_like_eager_on_cpu",)),
    # the capture's warm-up draws dropout masks from the live generators: the replays' masks drift from eager's
    Mutation("graph-capture-consumes-dropout-rng", "lightning_megatron/cuda_graphs/partial.py",
             "with preserved_rng(self.rng_tracker), _preserved_buffers(modules)", "with _preserved_buffers(modules)",
             (f"{STRATEGY}/test_strategy_features.py::test_partial_graphs_with_dropout_train_like_eager_through_the_trainer",)),
    # float8 weights cast once per schedule: a cast kept past the weights' change, or used outside its schedule
    Mutation("float8-weight-cast-stale", "lightning_megatron/quantization/float8_weights.py",
             "        weight = self._weight()\n", "        weight = self._weight()\n        if self.data is not None:\n            return\n",
             ("tests/unit/quantization/test_fp8_weight_casts.py::test_the_engine_casts_once_per_schedule_and_trains_as_recasting_does",)),
    Mutation("float8-weight-cast-armed-forever", "lightning_megatron/quantization/float8_weights.py",
             "            cast.armed = False\n", "            pass\n",
             ("tests/unit/quantization/test_fp8_weight_casts.py::test_the_engine_casts_once_per_schedule_and_trains_as_recasting_does",)),
    # ... or made at the schedule's start, before the overlapped parameter gather has brought the weights back
    Mutation("float8-weight-cast-before-param-gather", "lightning_megatron/quantization/float8_weights.py",
             "        cast.armed, cast.stale, cast.forward_only, cast.graphed = True, True, forward_only, graphed\n",
             "        cast.refresh()\n        cast.armed, cast.stale, cast.forward_only, cast.graphed = True, False, forward_only, graphed\n",
             ("tests/integration/strategy/test_fp8_updates.py::test_weights_cast_once_per_step_train_as_recasting_in_every_call[dp2-distopt-gather]",)),
    Mutation("param-gather-waits-after-other-pre-hooks", "lightning_megatron/distributed/param_buffer.py",
             "                                                                            prepend=True))",
             "                                                                            prepend=False))",
             ("tests/unit/distributed/test_distributed_optimizer.py::test_the_overlapped_gather_waits_before_the_modules_other_pre_hooks",)),
    Mutation("float8-cached-path-not-traced", "lightning_megatron/quantization/float8.py",
             "        if own_weight and cast is not None and cast.ready():",
             "        if own_weight and cast is not None and cast.ready() and not torch.compiler.is_compiling():",
             ("tests/unit/quantization/test_fp8_weight_casts.py::test_compiled_layers_trace_the_cached_casts_and_train_as_recasting_does",)),
    # evaluation casts the forward layout only; training must cast both
    Mutation("float8-weight-cast-transposed-never", "lightning_megatron/quantization/float8_weights.py",
             "                cast.refresh(transposed=not cast.forward_only)\n",
             "                cast.refresh(transposed=False)\n",
             ("tests/unit/quantization/test_fp8_weight_casts.py::test_the_engine_casts_once_per_schedule_and_trains_as_recasting_does",)),
    Mutation("float8-weight-cast-evaluation-transposes", "lightning_megatron/engine/step.py",
             "        with armed_weight_casts(self.weight_casts, forward_only, graphed):",
             "        with armed_weight_casts(self.weight_casts, graphed=graphed):",
             ("tests/unit/quantization/test_fp8_weight_casts.py::test_the_engine_casts_once_per_schedule_and_trains_as_recasting_does",)),
    # float8 column-parallel linears: the input gradient's collective started between the two backward GEMMs
    Mutation("float8-column-split-never-taken", "lightning_megatron/quantization/float8.py",
             "        self._check(x, weight, tokens)\n        return self\n",
             "        self._check(x, weight, tokens)\n        return None\n",
             ("tests/unit/quantization/test_fp8_column_overlap.py::test_float8_column_parallel_backward_overlaps_and_equals_the_whole_matmul",)),
    Mutation("float8-column-split-weight-grad-from-own-rows", "lightning_megatron/tensor_parallel/column_backward.py",
             "                    weight_grads[i] = gemms.weight_grad_gemm(operand, total, weight, saved)\n",
             "                    weight_grads[i] = gemms.weight_grad_gemm(operand, total.roll(1, 0), weight, saved)\n",
             ("tests/unit/quantization/test_fp8_column_overlap.py::test_float8_column_parallel_backward_overlaps_and_equals_the_whole_matmul",
              "tests/integration/strategy/test_fp8_updates.py::test_weights_cast_once_per_step_train_as_recasting_in_every_call[tp2sp-block-graphs]")),
    # grouped-query attention's q and kv as column-parallel linears on one input at tp > 1 (one collective overlapped)
    Mutation("attention-one-linear-kv-rows-shuffled", "lightning_megatron/transformer/attention.py",
             "            q, kv = column_parallel_linears(hidden, (self.q.weight, weight), (self.q.bias, bias), group,\n",
             "            q, kv = column_parallel_linears(hidden, (self.q.weight, weight.roll(1, 0)), (self.q.bias, bias), group,\n",
             ("tests/unit/transformer/test_attention_projection.py::test_queries_keys_and_values_as_one_overlapped_column_linear_equal_two_linears",)),
    Mutation("column-backward-input-grad-of-first-weight-only",
             "lightning_megatron/tensor_parallel/column_backward.py",
             "                    partial.addmm_(flat, weight)\n", "                    pass\n",
             ("tests/unit/transformer/test_attention_projection.py::test_queries_keys_and_values_as_one_overlapped_column_linear_equal_two_linears",)),
    Mutation("column-backward-accumulates-one-weight-only",
             "lightning_megatron/tensor_parallel/column_backward.py",
             "                into = None if ctx.accumulate_into is None else ctx.accumulate_into[i]\n",
             "                into = None if ctx.accumulate_into is None or i else ctx.accumulate_into[i]\n",
             ("tests/unit/transformer/test_attention_projection.py::test_queries_keys_and_values_as_one_overlapped_column_linear_equal_two_linears",)),
    # ECHO's weight exchange with the homes known on the host: only the used slots' blocks, placed in their slots
    Mutation("echo-exact-exchange-slots-misplaced", "lightning_megatron/moe/spare_weights.py",
             "        spare.index_copy_(0, positions, blocks)\n",
             "        spare.index_copy_(0, positions.flip(0), blocks)\n",
             ("tests/unit/moe/test_moe_echo_layer.py::test_spare_slots_hold_home_weights_and_return_gradients",)),
    Mutation("echo-exact-exchange-gradients-dropped", "lightning_megatron/moe/spare_weights.py",
             "            out.append(home.index_add_(0, index, part.reshape((-1,) + tuple(g.shape[1:]))))\n",
             "            out.append(home)\n",
             ("tests/unit/moe/test_moe_echo_layer.py::test_spare_slots_hold_home_weights_and_return_gradients",)),
    # ... only in CUDA graphs (eagerly the pieces' host work cost more than the overlap gained)
    Mutation("float8-column-split-outside-graphs", "lightning_megatron/quantization/float8.py",
             "        if cast is None or not cast.ready() or not cast.graphed:\n",
             "        if cast is None or not cast.ready():\n",
             ("tests/unit/quantization/test_fp8_column_overlap.py::test_float8_column_parallel_backward_overlaps_and_equals_the_whole_matmul",
              "tests/integration/strategy/test_fp8_updates.py::test_weights_cast_once_per_step_train_as_recasting_in_every_call[tp2sp]")),
    Mutation("float8-column-split-graphs-unannounced", "lightning_megatron/engine/step.py",
             "        graphed = (self.partial_graphs is not None or self.full_graph is not None) and not forward_only\n",
             "        graphed = False\n",
             ("tests/integration/strategy/test_fp8_updates.py::test_weights_cast_once_per_step_train_as_recasting_in_every_call[tp2sp-block-graphs]",)),
    Mutation("float8-column-split-ignores-bias", "lightning_megatron/tensor_parallel/column_backward.py",
             "            outs = (out if biases[0] is None else out + biases[0].to(out.dtype),)\n",
             "            outs = (out,)\n",
             ("tests/unit/quantization/test_fp8_column_overlap.py::test_float8_column_parallel_backward_overlaps_and_equals_the_whole_matmul",)),
    Mutation("graph-hooks-change-unnoticed", "lightning_megatron/cuda_graphs/partial.py",
             "            elif any(s.runners[0].hooks_changed() for s in self._states() if s.runners):",
             "            elif False:",
             ("tests/unit/cuda_graphs/test_cuda_graphs.py::test_parameter_gradients_reach_hooks_and_grads_as_autograd_delivers_them",)),
    Mutation("graph-tensor-hooks-run-twice", "lightning_megatron/cuda_graphs/runner.py",
             "        if self.grads_by_hand:\n", "        if False:\n", ("tests/unit/cuda_graphs/test_cuda_graphs.py::test_parameter_gradients_reach_hooks_and_grads_as_autograd_delivers_them",)),
    Mutation("graph-shared-params-delivered-by-each", "lightning_megatron/cuda_graphs/partial.py",
             "                    runner.grads_by_hand = False", "                    pass", ("tests/unit/cuda_graphs/test_cuda_graphs.py::test_parameter_gradients_reach_hooks_and_grads_as_autograd_delivers_them",)),
    # the whole-logits fused loss: the per-token output gradient left off the hidden states' gradient
    Mutation("whole-logits-loss-grad-unscaled", "lightning_megatron/tensor_parallel/fused_cross_entropy.py",
             "gemms.grad_hidden(grad_q, weight_q, hidden.dtype).to(torch.float32).mul_(g)",
             "gemms.grad_hidden(grad_q, weight_q, hidden.dtype).to(torch.float32)",
             ("tests/unit/tensor_parallel/test_fused_cross_entropy.py::test_matches_unfused[1]",), ci=False),
    # query/key norms: their one weight serves every tp rank's heads; the gradient left unsummed over tp
    Mutation("qk-norm-grads-not-summed-over-tp", "lightning_megatron/transformer/attention.py",
             "                param.sequence_parallel = True  # type: ignore[attr-defined]  # runtime attribute",
             "                pass",
             (f"{STRATEGY}/test_llama_strategy.py::test_qwen_attention_updates_match_single_process[tp4]",), ci=False),
    # YaRN: cos/sin left unscaled by the attention factor (the frequencies alone are right)
    Mutation("yarn-attention-factor-ignored", "lightning_megatron/transformer/rotary.py",
             "        if self.attention_factor != 1.0:", "        if False:",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[qwen2]",),
             ci=False),
    # pipeline layouts: the model builds what its layout says; the balance counts the output layer and loss
    Mutation("pipeline-layout-ignored-by-the-build", "lightning_megatron/transformer/stage_layers.py",
             "vp_rank, first_stage_layers, last_stage_layers, layout))", "vp_rank, first_stage_layers, last_stage_layers))",
             ("tests/unit/models/test_pipeline_layout.py::test_even_by_hand_and_the_pinned_ends",), ci=False),
    Mutation("balanced-layout-without-the-head", "lightning_megatron/models/pipeline_layout.py",
             "return model.layers, model.embedding, model.head", "return model.layers, model.embedding, 0",
             ("tests/unit/models/test_pipeline_layout.py::test_default_balances_the_output_layer_and_loss_against_the_layers",),
             ci=False),
    # a failed rank: its peers (stuck in a collective) end by themselves within the grace, naming it
    Mutation("failure-watch-peers-wait", "lightning_megatron/distributed/failure.py",
             "            _exit_later(self.exit_after_s, lambda: None, stop)\n", "            pass\n",
             ("tests/unit/distributed/test_failure_watch.py::test_a_failed_rank_ends_every_rank_and_is_named_by_the_others",),
             ci=False),
    # Gemma: norms scale by 1 + weight; GeGLU's GELU is the tanh approximation (transformers' gelu_pytorch_tanh)
    Mutation("gemma-norm-scales-by-weight", "lightning_megatron/transformer/norm.py",
             "(out * (1.0 + self.weight.float()))", "(out * self.weight.float())",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[gemma]",),
             ci=False),
    # the float8 output layer: its weight gradient must carry each token's output gradient (the loss's divisor)
    Mutation("fp8-output-weight-grad-without-token-scale", "lightning_megatron/quantization/float8_output.py",
             "scaled, inverse = _scaled(x, dtype, pow2, row_scale)", "scaled, inverse = _scaled(x, dtype, pow2)",
             ("tests/unit/quantization/test_fp8_output_layer.py::test_the_three_gemms_equal_the_definition",),
             ci=False),
    # ... and its hidden states' gradient from D unrounded (rounded to e5m2, the early loss plateau lasts longer)
    Mutation("fp8-output-grad-hidden-from-rounded-d", "lightning_megatron/quantization/float8_output.py",
             "return INPUT_DTYPE_GEMMS.grad_hidden(grad_q[:1], weight_q, dtype).to(dtype)",
             "return INPUT_DTYPE_GEMMS.grad_hidden(((grad_q[1].t().float() * grad_q[2]).to(grad_q[0].dtype),), "
             "weight_q, dtype).to(dtype)",
             ("tests/unit/quantization/test_fp8_output_layer.py::test_the_three_gemms_equal_the_definition",),
             ci=False),
    # ... on every virtual pipeline chunk that holds it (the last stage's output layer sits in its last chunk)
    Mutation("fp8-output-layer-first-chunk-only", "lightning_megatron/quantization/float8.py",
             "    for name, lm in models:", "    for name, lm in models[:1]:",
             ("tests/integration/strategy/test_fp8_updates.py",), ci=False),
    Mutation("geglu-exact-gelu", "lightning_megatron/ops/swiglu.py",
             'return F.gelu(gate, approximate="tanh") * up', "return F.gelu(gate) * up",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[gemma]",), ci=False),
    # Gemma 2: soft-capped scores and logits; sliding windows (Mistral's at cp2: the gathered keys' masks)
    Mutation("attention-softcap-ignored", "lightning_megatron/transformer/attention.py",
             "scale, softcap = self.config.softmax_scale, self.config.attn_logit_softcapping",
             "scale, softcap = self.config.softmax_scale, None",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[gemma2]",),
             ci=False),
    Mutation("final-logit-softcap-ignored", "lightning_megatron/models/gpt.py",
             "        if capping is not None:   # Gemma 2", "        if False:   # Gemma 2",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[gemma2]",),
             ci=False),
    Mutation("context-parallel-window-ignored", "lightning_megatron/transformer/context_parallel.py",
             "            if window is not None:   # query row i", "            if False:   # query row i",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[mistral]",),
             ci=False),
    Mutation("sandwich-feedforward-norms-swapped", "lightning_megatron/models/hf_llama.py",
             '"mlp_norm": "pre_feedforward_layernorm", "mlp_output_norm": "post_feedforward_layernorm"',
             '"mlp_norm": "post_feedforward_layernorm", "mlp_output_norm": "pre_feedforward_layernorm"',
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[gemma2]",),
             ci=False),
    # OLMo-2's q/k norms over all heads: a key/value head held by several tp ranks counts once in the statistics;
    # the replicated weight's gradient is summed over tp
    Mutation("across-heads-norm-sharing-ignored", "lightning_megatron/transformer/qk_norm.py",
             "variance = squares / (sharing * self.num_heads * self.head_dim)",
             "variance = squares / (self.num_heads * self.head_dim)",
             (f"{STRATEGY}/test_llama_strategy.py::test_sandwich_softcapped_windowed_layers_update_like_single_process[tp4sp]",),
             ci=False),
    # Gemma 3's windowed layers rotate by their own base; Qwen's window starts at max_window_layers (configs without
    # layer_types: transformers writes them, so only the config test sees the default)
    Mutation("window-rotary-base-ignored", "lightning_megatron/transformer/attention.py",
             "local_base = config.window_rotary_base if self.window is not None else None", "local_base = None",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[gemma3_text]",),
             ci=False),
    Mutation("qwen-window-on-every-layer", "lightning_megatron/models/hf_config.py",
             'first = hf.get("max_window_layers", layers)', "first = 0",
             ("tests/unit/models/test_hf_qwen2_moe.py::test_config_and_refusals",),
             ci=False),
    # LongRoPE: short factors while the positions stay within the original context (the positioned forward's)
    Mutation("longrope-always-long", "lightning_megatron/transformer/rotary.py",
             "return torch.where(positions.max() + 1 > self.original_context, long, inv_freq)", "return long",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[phi3_longrope]",),
             ci=False),
    Mutation("across-heads-norm-grads-not-summed-over-tp", "lightning_megatron/transformer/qk_norm.py",
             "        self.weight.sequence_parallel = True  # type: ignore[attr-defined]  # runtime attribute",
             "        pass",
             (f"{STRATEGY}/test_hf_dense_step.py::test_one_trainer_step_equals_transformers[olmo2-tp2sp]",), ci=False),
    Mutation("fused-loss-ignores-logit-softcap", "lightning_megatron/models/gpt.py",
             "chunk_size=self.cross_entropy_chunk_size, logit_softcapping=capping,",
             "chunk_size=self.cross_entropy_chunk_size, logit_softcapping=None,",
             ("tests/unit/tensor_parallel/test_fused_cross_entropy.py::test_gpt_model_fused_loss_and_grads_equal_unfused[sp-soft-capped]",),
             ci=False),
    Mutation("fused-loss-capped-gradient-unscaled", "lightning_megatron/tensor_parallel/fused_cross_entropy.py",
             "    return grad * _slope(capped, cap)", "    return grad",
             ("tests/unit/tensor_parallel/test_fused_cross_entropy.py::test_soft_capped_logits_match_unfused[1]",),
             ci=False),
    # Qwen3-MoE without norm_topk_prob keeps the top-k of a softmax over every expert (not renormalised)
    Mutation("qwen3-moe-topk-renormalised", "lightning_megatron/models/hf_config.py",
             'pre_softmax=qwen and not hf.get("norm_topk_prob", False)', "pre_softmax=False",
             ("tests/unit/models/test_hf_llama.py::test_import_gives_transformers_logits_and_export_loads[qwen3_moe]",),
             ci=False),
    # hf_pooled: transformers' balancing loss pools every layer's statistics, over tp/cp token splits and stages
    Mutation("hf-pooled-per-layer", "lightning_megatron/moe/pooled_aux_loss.py",
             "batch.local = stats if batch.local is None else batch.local + stats", "batch.local = stats",
             (f"{STRATEGY}/test_hf_moe_balancing.py::test_one_step_equals_transformers[mixtral-1]",), ci=False),
    Mutation("hf-pooled-no-tp-cp-sum", "lightning_megatron/moe/router.py",
             "mb = ledger.record(self, sum_over(stats, group))", "mb = ledger.record(self, stats)",
             (f"{STRATEGY}/test_hf_moe_balancing.py::test_one_step_equals_transformers[mixtral-tp2sp]",), ci=False),
    Mutation("hf-pooled-stage-alone", "lightning_megatron/moe/pooled_aux_loss.py",
             "            if self.pp_group is None:\n                batch.total", "            if True:\n                batch.total",
             (f"{STRATEGY}/test_hf_moe_balancing.py::test_one_step_equals_transformers[mixtral-pp2]",), ci=False),
    # Qwen2-MoE's shared expert is gated by a sigmoid, per token (its gradient summed over tp under sequence parallelism)
    Mutation("shared-gate-without-sigmoid", "lightning_megatron/moe/layer.py",
             "out * torch.sigmoid(self.shared_expert_gate(x))", "out * self.shared_expert_gate(x)",
             ("tests/unit/models/test_hf_qwen2_moe.py::test_import_gives_transformers_logits_and_export_loads",), ci=False),
    Mutation("shared-gate-no-sequence-parallel-grad", "lightning_megatron/moe/layer.py",
             "gate.weight.sequence_parallel = self.sequence_parallel", "gate.weight.sequence_parallel = False",
             (f"{STRATEGY}/test_hf_moe_balancing.py::test_one_step_equals_transformers[qwen2_moe-tp2sp]",), ci=False),
    # the hang detector: progress is what it judges, and it names the rank(s) outside the majority's place
    Mutation("hang-watch-blind-to-progress", "lightning_megatron/distributed/hang.py",
             'signature = (rec["ticks"], rec["python"], rec["finished"])', 'signature = (rec["finished"],)',
             ("tests/unit/distributed/test_hang_watch.py::test_a_healthy_run_with_a_short_timeout_is_left_alone",),
             ci=False),
    Mutation("hang-report-names-everyone", "lightning_megatron/distributed/hang_report.py",
             "        return outside", "        return running",
             ("tests/unit/distributed/test_hang_watch.py::test_who_differs",), ci=False),
    Mutation("dead-rank-never-called-gone", "lightning_megatron/distributed/hang.py",
             "and now - heard[r][1] >= dead_after > 0", "and False",
             ("tests/unit/distributed/test_hang_watch.py::test_a_rank_whose_watcher_stopped_answering_is_called_gone_on_every_other_rank",),
             ci=False),
    # ZB-H1: every micro-batch's weight pass runs, after its backward, through autograd (the DP hooks fire there)
    Mutation("zero-bubble-last-weight-pass-skipped", "lightning_megatron/pipeline/executor.py",
             "            self.weight_grads.pop(key).run()\n",
             "            queue = self.weight_grads.pop(key)\n"
             "            if step.microbatch != self.data.num_microbatches - 1:\n                queue.run()\n",
             (f"{STRATEGY}/test_zero_bubble_updates.py::test_zero_bubble_updates_match_single_process[pp2]",), ci=False),
    Mutation("zero-bubble-weight-before-backward", "lightning_megatron/pipeline/zero_bubble.py",
             "        steps.append(ScheduleStep(BACKWARD, 0, i))\n        weight()\n",
             "        weight()\n        steps.append(ScheduleStep(BACKWARD, 0, i))\n",
             ("tests/unit/pipeline/test_zero_bubble.py::test_order_properties[4]",), ci=False),
    Mutation("zero-bubble-weight-grads-bypass-hooks", "lightning_megatron/tensor_parallel/deferred_wgrad.py",
             "            torch.autograd.backward([weight for weight, _ in summed.values()],\n"
             "                                    [dw.to(weight.dtype) for weight, dw in summed.values()])\n",
             "            with torch.no_grad():\n"
             "                for weight, dw in summed.values():\n"
             "                    weight.grad = dw.to(weight.dtype) if weight.grad is None else weight.grad + dw\n",
             (f"{STRATEGY}/test_zero_bubble_updates.py::test_zero_bubble_updates_match_single_process[dp2pp2-distopt-overlap]",),
             ci=False),
    Mutation("compiled-zero-bubble-gradless-hook-counted", "lightning_megatron/distributed/data_parallel.py",
             "        elif param.grad is None:   # the accumulator was reached with no gradient",
             "        elif False:   # the accumulator was reached with no gradient",
             (f"{STRATEGY}/test_zero_bubble_updates.py::test_zero_bubble_updates_match_single_process"
              "[dp2pp2-distopt-overlap-compiled]",), ci=False),
    # gradient-accumulation fusion: each product added into the gradient, and the bucket counted ready
    Mutation("fused-accumulation-overwrites-the-sum", "lightning_megatron/tensor_parallel/grad_accumulation.py",
             "            target.addmm_(g.t(), x)\n",
             "            target.copy_(g.t().mm(x))\n",
             ("tests/integration/strategy/test_grad_accumulation_fusion.py::"
              "test_fused_gradient_accumulation_matches_single_process[dp2tp2sp-distopt-overlap]",), ci=False),
    Mutation("fused-weights-never-counted-ready", "lightning_megatron/distributed/data_parallel.py",
             "            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]  # runtime attribute\n",
             "            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]  # runtime attribute\n"
             "            return\n",
             ("tests/unit/tensor_parallel/test_grad_accumulation.py::"
              "test_fused_weights_issue_their_buckets_inside_the_last_backward",), ci=False),
    # tp_comm_overlap: the ring's chunks and the weight gradient's gathered operand
    Mutation("comm-overlap-reduce-scatter-chunk-off-by-one", "lightning_megatron/tensor_parallel/comm_overlap.py",
             "        partial = _chunk(x, (rank - step - 1) % size, size) @ weight\n",
             "        partial = _chunk(x, (rank - step) % size, size) @ weight\n",
             ("tests/unit/tensor_parallel/test_comm_overlap.py::test_overlapped_linears_equal_the_plain_sequence_parallel_path",
              f"{UPDATES}[tp2sp-commoverlap]"), ci=False),
    Mutation("comm-overlap-weight-grad-from-own-chunk-only", "lightning_megatron/tensor_parallel/comm_overlap.py",
             "        grad_w = _weight_grad(grad, gathered)\n",
             "        grad_w = _weight_grad(grad, x.repeat(size, *([1] * (x.dim() - 1))))\n",
             (f"{UPDATES}[tp2sp-commoverlap]",), ci=False),
    # column-parallel linears: the input gradient's collective, overlapped with the weight gradient
    Mutation("column-backward-input-grad-not-reduce-scattered", "lightning_megatron/tensor_parallel/column_backward.py",
             "                work = dist.reduce_scatter_tensor(grad_x, partial, group=ctx.group, async_op=True)\n",
             "                grad_x = partial.chunk(size)[dist.get_rank(ctx.group)]\n",
             (f"{UPDATES}[tp2sp]",), ci=False),
    Mutation("column-backward-input-grad-not-all-reduced", "lightning_megatron/tensor_parallel/column_backward.py",
             "                work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)\n", "",
             (f"{UPDATES}[tp2]",), ci=False),
    # a launcher's SIGTERM shortens the wait for a silent peer
    Mutation("sigterm-ignored-by-the-dead-rank-check", "lightning_megatron/distributed/hang.py",
             "terminated = self.dead_after_s > 0 and self.sigterm_seen()", "terminated = False",
             ("tests/unit/distributed/test_hang_watch.py::test_after_sigterm_a_silent_peer_is_called_gone_within_seconds",),
             ci=False),
    # checkpoints: background saves write a snapshot; checksums are checked
    Mutation("background-save-without-snapshot", "lightning_megatron/checkpoint/stage.py",
             "    _copy(plan.cpu_targets, plan.cpu_sources)   # at the save's point: training changes these once the "
             "call returns\n",
             "    land = (lambda: _copy(plan.cpu_targets, plan.cpu_sources)) if not plan.gpu_sources else land\n",
             (f"{STRATEGY}/test_background_save.py::test_background_saves_resume_like_synchronous_ones_bit_for_bit",),
             ci=False),
    Mutation("background-save-buffers-not-reserved", "lightning_megatron/adapter/checkpoint_hooks.py",
             "            if save_options(self.checkpoint_io)[0]:", "            if False:",
             (f"{STRATEGY}/test_background_save.py::test_the_host_buffers_are_made_after_the_first_optimizer_step_"
              "not_at_the_first_save",), ci=False),
    Mutation("background-save-cache-ignores-storage", "lightning_megatron/checkpoint/tensor_cache.py",
             "    return [(id(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors]",
             "    return [(id(t), t.shape, t.stride(), t.dtype) for t in tensors]",
             ("tests/unit/checkpoint/test_tensor_cache.py::test_a_background_save_after_param_data_was_swapped_writes_"
              "the_new_tensor",), ci=False),
    Mutation("pipeline-shape-learned-from-mixed-shapes", "lightning_megatron/engine/activation_shapes.py",
             "return next(iter(distinct)) if len(distinct) == 1 else None",
             "return next(iter(distinct)) if distinct else None",
             ("tests/unit/engine/test_activation_shapes.py::test_shapes_are_learned_once_per_micro_batch_shape_and_the_"
              "updates_stay_exact",), ci=False),
    Mutation("pipeline-shape-not-agreed", "lightning_megatron/engine/activation_shapes.py",
             "if first[0] >= 0 and all(r == first for r in everyone):",
             "if row[0] >= 0:  # noqa",
             ("tests/unit/engine/test_activation_shapes.py::test_no_stage_learns_a_shape_unless_every_stage_saw_"
              "the_same_one",), ci=False),
    Mutation("checksum-not-compared", "lightning_megatron/checkpoint/checksums.py",
             "if length != sinfo.length or actual != expected:", "if length != sinfo.length:",
             ("tests/unit/checkpoint/test_checkpoint_checksums.py",), ci=False),
]


def mutated_copy(mutation: Mutation, into: Path) -> None:
    """The package and tests copied into ``into`` with ``mutation`` applied (exactly one match)."""
    for part in ("lightning_megatron", "tests"):
        shutil.copytree(ROOT / part, into / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    target = into / mutation.path
    text = target.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(f"mutation {mutation.name!r}: its text occurs {count} times in {mutation.path} "
                         "(expected once); update the mutation to the current source.")
    target.write_text(text.replace(mutation.old, mutation.new))


def run(mutation: Mutation, timeout: float = 900) -> Tuple[bool, float, str]:
    """(killed, seconds, pytest's last line): killed when the mutated package fails its tests."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as folder:
        into = Path(folder)
        mutated_copy(mutation, into)
        env = dict(os.environ, PYTHONPATH=str(into), PYTHONDONTWRITEBYTECODE="1")
        # one interpreter checks that the mutated copy is what gets imported (else exit 3, never a
        # "killed"), then runs pytest (exit 1: some test failed)
        script = ("import sys, pytest, lightning_megatron\n"
                  f"if not lightning_megatron.__file__.startswith({str(into)!r}):\n"
                  "    print('imported', lightning_megatron.__file__, 'not the mutated copy', file=sys.stderr)\n"
                  "    sys.exit(3)\n"
                  "sys.exit(pytest.main(sys.argv[1:]))")
        proc = subprocess.run([sys.executable, "-c", script, "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=",
                               *mutation.tests], cwd=into, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode == 1, time.perf_counter() - start, lines[-1] if lines else proc.stderr[-300:]


# imported once by the warm runner, then shared by every forked mutation run (about 10 s each otherwise)
WARM_IMPORTS = ("torch", "torch.distributed", "torch.nn.functional", "torch._dynamo", "numpy", "pytest",
                "lightning", "lightning.pytorch", "torchmetrics")


def control(mutations: List[Mutation]) -> Mutation:
    """No change at all, run on every test of ``mutations`` by the same warm runner: they must pass, so a
    failure of a mutated copy is the plant's, not the runner's (its ranks are forks, not a fork server's)."""
    first = mutations[0]
    return Mutation(UNMUTATED, first.path, first.old, first.old,
                    tuple(sorted({test for mutation in mutations for test in mutation.tests})))


UNMUTATED = "unmutated"


def run_warm(mutations: List[Mutation], jobs: int = 2, timeout: float = 900) -> Dict[str, Tuple[int, float, str]]:
    """``run`` for many mutations at once: this process imports the heavy dependencies once, then forks one
    child per mutation (``jobs`` at a time), which drops any imported copy of the package, puts its mutated
    copy first on the path and runs pytest on the mutation's tests, its ranks forked from it. Returns each
    one's (pytest exit code, seconds, pytest's last line): 1 is killed. Pass :func:`control` among them to see
    the unmutated tests pass the same way."""
    import importlib
    import signal

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    folders: Dict[str, Path] = {}
    results: Dict[str, Tuple[int, float, str]] = {}
    running: Dict[int, Tuple[Mutation, float]] = {}
    queue = list(mutations)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                mutation = queue.pop(0)
                into = folders[mutation.name] = Path(tempfile.mkdtemp(prefix=f"mutation-{mutation.name}-"))
                mutated_copy(mutation, into)
                pid = os.fork()
                if pid == 0:   # the child: never returns
                    os._exit(_child(mutation, into))
                running[pid] = (mutation, time.perf_counter())
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                for pid, (mutation, start) in list(running.items()):
                    if time.perf_counter() - start > timeout:
                        os.killpg(pid, signal.SIGKILL)
                time.sleep(0.2)
                continue
            mutation, start = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            log = (folders[mutation.name] / "pytest.log").read_text(errors="replace")
            lines = [line for line in log.splitlines() if line.strip()]
            results[mutation.name] = (code, time.perf_counter() - start, lines[-1] if lines else f"exit {code}")
            _kill_group(pid)
    finally:
        for pid in running:
            _kill_group(pid)
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    return results


def _kill_group(pid: int) -> None:
    """The child's own ranks and fork server (its process group) go with it."""
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child(mutation: Mutation, into: Path) -> int:
    """Run the mutation's tests against the copy in ``into``: 1 when a test failed (killed), 3 when the
    copy was not what got imported, else pytest's code. Output goes to ``into/pytest.log``."""
    import torch

    os.setpgid(0, 0)
    log = os.open(into / "pytest.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for name in [n for n in sys.modules if n == "lightning_megatron" or n.startswith(("lightning_megatron.", "helpers"))]:
        del sys.modules[name]
    sys.path[:] = [str(into), str(into / "tests")] + [p for p in sys.path if not p.startswith(str(ROOT))]
    # the ranks are forks of this child (which already holds torch, Lightning and the mutated package) rather
    # than of a fork server that imports them all again (~10 s per mutation); one intra-op thread, so no
    # OpenMP pool exists to be broken by the fork
    os.environ.update(PYTHONPATH=str(into), PYTHONDONTWRITEBYTECODE="1", LIGHTNING_MEGATRON_RANKS_START_METHOD="fork")
    torch.set_num_threads(1)
    os.chdir(into)
    # the ranks' fork server must not re-run this runner as their __main__ (nor a caller's <stdin>)
    vars(sys.modules["__main__"]).pop("__file__", None)
    import pytest
    import lightning_megatron

    if not lightning_megatron.__file__.startswith(str(into)):
        print("imported", lightning_megatron.__file__, "not the mutated copy", flush=True)
        return 3
    code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", *mutation.tests]))
    sys.stdout.flush()
    return code


def main(argv: List[str]) -> int:
    if "--list" in argv:
        for m in MUTATIONS:
            print(f"{m.name:40s} {m.path}  ->  {' '.join(m.tests)}")
        return 0
    as_json = "--json" in argv
    names = [a for a in argv if not a.startswith("--")]
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    if "--ci" in argv:
        chosen = [m for m in chosen if m.ci]
    codes = run_warm([control(chosen), *chosen])   # the control first: the longest job
    if as_json:
        import json

        print(json.dumps(codes))
        return 0
    code, seconds, last = codes[UNMUTATED]
    print(f"{'passed' if code == 0 else 'FAILED':8s} {seconds:6.1f}s  {UNMUTATED} (every test, no plant): {last}")
    rows = [(m, codes[m.name][0] == 1, *codes[m.name][1:]) for m in chosen]
    for mutation, killed, seconds, last in rows:
        print(f"{'killed' if killed else 'SURVIVED':8s} {seconds:6.1f}s  {mutation.name}: {last}", flush=True)
    print("\n| mutation | file | caught by | result |\n|---|---|---|---|")
    for mutation, killed, seconds, last in rows:
        tests = ", ".join(t.split("::", 1)[1] for t in mutation.tests)
        print(f"| {mutation.name} | `{mutation.path}` | `{tests}` | {'killed' if killed else '**survived**'} |")
    return 0 if code == 0 and all(killed for _, killed, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
