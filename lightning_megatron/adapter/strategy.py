"""``Trainer(strategy="megatron")``: Megatron-style parallelism for an ordinary LightningModule.

This file speaks Lightning; everything it drives (process groups, schedules, gradient
reduction, clipping) lives below it and knows nothing of Lightning.

One training step (one Lightning batch per data-parallel rank and optimizer step): split the
batch into micro-batches, run the pipeline schedule (forward and backward of every micro-batch,
the user's ``training_step`` on the last stage), reduce gradients across the parallel groups,
then let Lightning clip and step. Lightning's own backward is a no-op: the schedule ran it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.constants import default_pg_timeout

from ..checkpoint.trainer_state import (load_trainer_checkpoint, loaded_in_place, remove_checkpoint_path,
                                      save_trainer_checkpoint)
from ..distributed import FullOptimizerView
from ..distributed.gradients import GradientState, checkpoint_views
from ..engine.microbatches import ragged_last_batch
from ..engine import StepEngine
from ..engine.replicas import (in_dataset_order, make_replicas_identical, seed_identically,
                              sync_metrics_over_data_parallel)
from ..cuda_graphs.config import CudaGraphConfig
from ..distributed.config import GradientConfig
from ..parallel.config import ParallelConfig
from ..transformer.config import model_defaults
from ..parallel import ParallelState
from ..tensor_parallel.random import get_rng_tracker
from ..quantization.float8 import Float8Config, enable_fp8, fp8_config
from .precision import parallel_precision
from ..parallel.topology import DEFAULT_ORDER
from ..pipeline.shared_embeddings import check_tied_optimizer_settings
from ..moe import update_expert_biases
from .resumable_loader import ResumableLoader
from .sampler_check import sampler_shards_wrongly, wrong_sampler_message
from .last_stage import (TrainingLastStage, batch_output, call_hooks, check_automatic_optimization, check_model_kept,
                         check_per_token_accumulation)
from ..engine.step_logging import DATA_PARALLEL_GROUP, broadcast_from_last_stage, replay, to_host

class MegatronStrategy(ParallelStrategy):
    """Tensor (+sequence), pipeline (1F1B / interleaved), data, context and expert parallelism.

    Args:
        tensor_model_parallel_size / pipeline_model_parallel_size / context_parallel_size /
        expert_model_parallel_size / expert_tensor_parallel_size: the layout; the data-parallel
            size is what is left of the world (``world / (tp·cp·pp)``).
        virtual_pipeline_model_parallel_size: local model chunks per pipeline rank (interleaved
            1F1B); build the model with ``lightning_megatron.pipeline.VirtualChunks``.
        order: rank order of the axes, fastest first (seed 001).
        sequence_parallel: shard activations outside tensor-parallel regions along the sequence.
        micro_batch_size: samples per micro-batch; the per-rank batch must be a multiple of it.
            ``None`` runs each batch as one micro-batch.
        timeout: process-group timeout; a rank that fails makes its peers fail after this.
        overlap_grad_reduce: reduce each gradient bucket over data parallelism as soon as the last
            micro-batch's backward has produced it, overlapping communication with the backward.
        bucket_size: elements per gradient bucket (default: one bucket, or max(40M, 1M·dp) elements
            with ``overlap_grad_reduce``).
        grad_reduce_in_fp32: accumulate and reduce bf16/fp16 gradients in float32 buffers.
        use_distributed_optimizer: shard float32 main parameters and optimizer state over data
            parallelism (ZeRO-1); the optimizer from ``configure_optimizers`` must be elementwise
            (SGD, Adam, AdamW, ...).
        overlap_param_gather: with the distributed optimizer, all-gather the updated parameters in
            the background and wait per module at its next forward. Between steps parameters are
            then current only after ``strategy.finish_param_sync()`` (checkpoints, evaluation and
            the end of fit call it; a callback reading weights must call it too).
        fp8: train the linear layers in float8 through torchao: ``"tensorwise"``, ``"rowwise"`` or a
            ``lightning_megatron.quantization.float8.Float8Config`` (``None``: off); needs ``pip install
            'lightning-megatron[fp8]'`` and a GPU of compute capability >= 8.9.
        calculate_per_token_loss: ``training_step`` returns ``{"loss": <sum of token losses>, "num_tokens":
            <their count>}`` and the gradients are divided by the global batch's token count: one process's
            per-token mean however the labelled tokens spread over micro-batches, data and context ranks.

    Any of the last five switches gradients into contiguous buffers (``param.main_grad``; the
    optimizer still reads ``.grad``); with none of them, gradients stay in ``.grad`` and are
    reduced by one coalesced all-reduce after the schedule.
    """

    strategy_name = "megatron"

    def __init__(self, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size: Optional[int] = None, context_parallel_size: int = 1,
                 expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                 order: str = DEFAULT_ORDER, sequence_parallel: bool = False,
                 micro_batch_size: Optional[int] = None,
                 microbatch_group_size_per_vp_stage: Optional[int] = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: str = "popen", cuda_graph: Optional[str] = None,
                 cuda_graph_scope: Union[str, List[str]] = "layer", cuda_graph_warmup_steps: int = 1,
                 cuda_graph_backend: str = "cuda",
                 overlap_grad_reduce: bool = False, bucket_size: Optional[int] = None,
                 grad_reduce_in_fp32: bool = False, use_distributed_optimizer: bool = False,
                 overlap_param_gather: bool = False, fp8: Union[None, str, Float8Config] = None,
                 calculate_per_token_loss: bool = False,
                 accelerator: Optional[Accelerator] = None, parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        # validated here, on every rank, before any process group exists
        self.parallel = ParallelConfig(
            tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
            context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size, order, sequence_parallel,
            micro_batch_size, microbatch_group_size_per_vp_stage)
        self.gradient_config = GradientConfig(overlap_grad_reduce, bucket_size, grad_reduce_in_fp32,
                                              use_distributed_optimizer, overlap_param_gather)
        self.graph_config = CudaGraphConfig(cuda_graph, cuda_graph_scope, cuda_graph_warmup_steps, cuda_graph_backend)
        self.graph_config.check_with(self.gradient_config)
        self.fp8 = fp8_config(fp8)   # validated here; torchao and the GPU are checked at setup
        self.calculate_per_token_loss = bool(calculate_per_token_loss)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r} is not one of 'popen', 'spawn', 'fork', 'forkserver'.")
        self.engine: Optional[StepEngine] = None          # runs the steps (built in setup)
        self.gradients: Optional[GradientState] = None    # where the gradients live (built in setup when fitting)
        self._final_optimizer_states: Dict[int, FullOptimizerView] = {}    # gathered at the end of fit
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.num_nodes = 1
        self.parallel_state: Optional[ParallelState] = None
        self._accumulating = False

    # -- Lightning plumbing --------------------------------------------------------------------------

    # Lightning's own (DDPStrategy's, borrowed rather than inherited: DDPStrategy would wrap the model in DDP)
    root_device = DDPStrategy.root_device
    num_processes = DDPStrategy.num_processes
    process_group_backend = DDPStrategy.process_group_backend
    set_world_ranks = DDPStrategy.set_world_ranks
    model_to_device = DDPStrategy.model_to_device
    determine_ddp_device_ids = DDPStrategy.determine_ddp_device_ids
    barrier = DDPStrategy.barrier       # on the world group, as Lightning's callbacks expect
    broadcast = DDPStrategy.broadcast

    @property
    def is_distributed(self) -> bool:
        """Lightning then shards the data with a DistributedSampler (by data-parallel rank)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Data is sharded by data-parallel rank: tp/cp/pp peers read the same samples."""
        state = self._state()
        return {"num_replicas": state.dp_size, "rank": state.dp_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # torchrun/srun started the processes: the script launcher starts none, but first checks that
        # devices x num_nodes is the world the launcher made (else a bare IndexError on the extra ranks)
        if self.cluster_environment.creates_processes_externally or self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        world = self.num_nodes * self.num_processes
        layout = self.parallel.layout(world)   # pure: every rank raises the same error before any group exists
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        kwargs: Dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if self.parallel_state is not None:   # a previous fit/validate of this strategy
            self.parallel_state.destroy()
        state = ParallelState(layout, timeout=self._timeout,
                              virtual_pipeline_size=self.parallel.virtual_pipeline_model_parallel_size)
        self.parallel_state = state.activate()
        seed_identically(self.parallel_state, self.root_device)

    def setup(self, trainer: "L.Trainer") -> None:  # noqa: F821
        assert self.model is not None and self.accelerator is not None
        self.precision_plugin = parallel_precision(self.precision_plugin, None)   # checked before any work
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_automatic_optimization(self.lightning_module)
            check_per_token_accumulation(self.calculate_per_token_loss, trainer.accumulate_grad_batches)
        enable_fp8(self.lightning_module, self.fp8)   # the model exists (configure_model), the optimizer not yet
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        make_replicas_identical(self.model, self._state())
        sync_metrics_over_data_parallel(self.model, self._state())
        if fitting:
            self.setup_optimizers(trainer)
            self._setup_gradients()
        self.precision_plugin = parallel_precision(self.precision_plugin, self.gradients)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.engine is not None:
            self.engine.close()
        self.engine = StepEngine(
            self.lightning_module, self._state(), device=self.root_device, micro_batch_size=self.parallel.micro_batch_size,
            microbatch_group_size_per_vp_stage=self.parallel.microbatch_group_size_per_vp_stage,
            calculate_per_token_loss=self.calculate_per_token_loss, **dataclasses.asdict(self.graph_config))

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs inside: models built there take the strategy's ``sequence_parallel``; one
        that rebuilds the model an earlier run of the module trained is refused."""
        module = self.lightning_module
        before = {id(p) for p in module.parameters()} if module is not None else set()
        with model_defaults(sequence_parallel=self.parallel.sequence_parallel):
            yield
        if module is not None:
            check_model_kept(module, before)

    def _state(self) -> ParallelState:
        if self.parallel_state is None:
            raise RuntimeError("the megatron strategy's process groups do not exist yet (before setup_environment).")
        return self.parallel_state

    # -- gradient buffers and the distributed optimizer -----------------------------------------------

    def _setup_gradients(self) -> None:
        """Where gradients live (after the optimizers exist: the distributed optimizer re-points them at its
        shards)."""
        check_tied_optimizer_settings(self.model.named_parameters(), self._raw_optimizers(), self._state().pp_size)
        if self.gradients is not None:
            self.gradients.close()
        self._final_optimizer_states = {}
        self.gradients = GradientState(list(self.model.parameters()), self._state(), self.gradient_config,
                                       optimizers=self._raw_optimizers(), modules=[self.model], device=self.root_device)

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers of ``overlap_param_gather``: call before reading parameters
        outside a forward between steps (e.g. in a callback); checkpoints and the end of fit do it."""
        if self.gradients is not None:
            self.gradients.finish_param_sync()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The user's optimizer steps on its shards; then every rank's parameters are made whole again."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.gradients.after_optimizer_step()
        if self.engine.routers:
            update_expert_biases(self.engine.routers)   # aux-loss-free balancing: after the step
        return out

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm as one process computes it, the same on every rank at every layout;
        a collective: call it on every rank between backward and the optimizer step (``on_before_optimizer_step``).
        Lightning's ``grad_norm(module)`` sees this rank's shards only (under the distributed optimizer, none)."""
        if self.gradients is None:
            raise RuntimeError("strategy.grad_norm() reads the gradients of a training step: call it while fitting, "
                               "e.g. in on_before_optimizer_step.")
        return self.gradients.norm([p for opt in self._raw_optimizers() for group in opt.param_groups
                                    for p in group["params"]], norm_type)

    def on_train_end(self) -> None:
        """The process groups go with ``teardown``: keep the whole optimizer state (host memory) for a
        ``trainer.save_checkpoint`` after ``fit``."""
        self.finish_param_sync()
        if self.gradients is not None:
            self._final_optimizer_states = self.gradients.gather_optimizer_states()

    # -- the training step -----------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the whole schedule, forward and backward of every micro-batch. ``on_before_backward``
        is called per micro-batch on the last pipeline stage with the loss about to be backpropagated
        (divided by ``accumulate_grad_batches``, before loss scaling); ``on_after_backward`` once, when
        the gradients are handed back to Lightning."""
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        gradients = self.gradients
        if args[1] % accumulate == 0:   # first batch of an accumulation window: start from zero
            gradients.zero()
        gradients.before_schedule()
        last_stage = TrainingLastStage(self.lightning_module, args[1:], kwargs, scaler, self.calculate_per_token_loss)
        with gradients.no_sync() if self._accumulating else nullcontext():
            # MoE balancing losses inject their gradient inside backward: they get the main loss's factor
            result = self.engine.run(args[0], last_stage, step_context=self.precision_plugin.train_step_context,
                                     no_sync=gradients.schedule_no_sync,
                                     aux_loss_scale=(scaler.get_scale() if scaler is not None else 1.0) / accumulate,
                                     extras=last_stage.extras)
        if not self._accumulating:
            gradients.finalize([self.model])
            if result.grad_scale is not None:   # per-token losses: divided by the global token count
                gradients.scale(result.grad_scale)
        gradients.hide()   # Lightning zeroes gradients between training_step and backward: keep them away
        replay(self.lightning_module, result.logs, self.root_device)
        outputs = dict(result.extras or {}, loss=result.loss)   # what on_train_batch_end gets
        if result.num_tokens is not None:
            outputs["num_tokens"] = result.num_tokens   # the global batch's, as one process counts it
        return outputs

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran every backward inside ``training_step``: hand its gradients back."""
        self.gradients.expose()
        call_hooks(self.lightning_module.trainer, "on_after_backward")
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation across Lightning batches: reduce only before the optimizer step."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _eval_step(self, hook: str, context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        result = self.engine.run(args[0], lambda mb: getattr(module, hook)(mb, *args[1:], **kwargs),
                                 forward_only=True, step_context=context)
        replay(module, result.logs, self.root_device)
        return batch_output(result.outputs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._eval_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)
        return broadcast_from_last_stage(to_host(out), self._state())   # rank 0 holds the first stage

    def process_dataloader(self, dataloader: Any) -> Any:
        """A user's DistributedSampler must shard by data-parallel rank (checked on every rank, raised on every
        rank); training loaders resume mid-epoch exactly (Lightning alone replays the epoch's batches)."""
        from lightning.pytorch.trainer.states import RunningStage
        from torch.utils.data import DataLoader

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        shards = self.distributed_sampler_kwargs
        if self.reduce_boolean_decision(sampler_shards_wrongly(dataloader, **shards), all=False):
            stage = trainer.state.stage.value if trainer is not None and trainer.state.stage else "evaluation"
            raise ValueError(wrong_sampler_message(dataloader, stage, shards["num_replicas"]))
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING and isinstance(dataloader, DataLoader):
            last = ragged_last_batch(dataloader, self.parallel.micro_batch_size)
            if last is not None:   # raised at that step; said now, before an epoch of work
                rank_zero_warn(f"The last training batch of every epoch holds {last} samples per data-parallel "
                               f"rank, which micro_batch_size={self.parallel.micro_batch_size} does not divide: that "
                               "step will be refused. Set drop_last=True on the DataLoader, or a batch size whose "
                               "remainder it divides.")
            return ResumableLoader(dataloader, current_epoch=lambda: trainer.current_epoch)
        return dataloader

    def on_predict_end(self) -> None:
        """Predictions of every data-parallel rank, put back in dataset order on every rank."""
        loop = self.lightning_module.trainer.predict_loop
        if self._state().dp_size == 1 or not loop.return_predictions:
            return
        loaders = self.lightning_module.trainer.predict_dataloaders
        for index, batches in enumerate(loop._predictions):
            total = len((loaders[index] if isinstance(loaders, (list, tuple)) else loaders).dataset)
            ordered = in_dataset_order(batches, self._state(), total)
            if ordered is None:
                rank_zero_warn("predict_step returned something other than tensors (in dicts, tuples or lists) with "
                               "the batch as their first dimension: under data parallelism each rank returns its own "
                               "samples' predictions, not the whole dataset's in order. Return tensors for that.")
            else:
                batches[:] = ordered

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        if group is DATA_PARALLEL_GROUP:   # what the replayed logs sync over: this run's data-parallel group
            group = self._state().dp_group   # (the step combined them over cp already)
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- checkpoints -------------------------------------------------------------------------------------
    # Sharded (torch.distributed.checkpoint, reshardable across TP/PP/VPP/DP/EP) unless the distributed
    # optimizer is on: its state is gathered into one file per rank, which reshards the DP size only.

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded loading reads straight into the parameters and optimizers: they must exist."""
        return True

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        self.finish_param_sync()
        return {}   # save_checkpoint writes the parameters shard by shard

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if loaded_in_place(checkpoint):
            return   # load_checkpoint already read every shard into place
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.gradients is not None:
            self.gradients.reload_main_params()

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        return {}   # save_checkpoint writes the optimizer state shard by shard

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not loaded_in_place(checkpoint):
            raise ValueError("the megatron strategy loads its own sharded checkpoint folders (load_checkpoint) only.")

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A sharded folder written by every rank, with or without the distributed optimizer; it resumes at
        any layout."""
        save_trainer_checkpoint(self.broadcast(str(filepath)), checkpoint, [self.lightning_module],
                                self._checkpoint_optimizers(saving=True), get_rng_tracker(self._state()))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """A sharded folder (from any layout, with or without the distributed optimizer), read into place;
        optimizer states only when fitting."""
        trainer = self.lightning_module.trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        return load_trainer_checkpoint(str(self.broadcast(str(checkpoint_path))), [self.lightning_module],
                                       self._checkpoint_optimizers(saving=False) if fitting else None,
                                       get_rng_tracker(self._state()), strict=self.lightning_module.strict_loading)

    def _raw_optimizers(self) -> List[Any]:
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]

    def _checkpoint_optimizers(self, saving: bool) -> List[Any]:
        """What the sharded checkpoint reads and writes: each optimizer as the plain optimizer over the
        model's parameters, so one format reshards TP/PP/EP/DP with or without the distributed optimizer."""
        sharded = self.gradients.distributed_optimizer if self.gradients is not None else None
        return checkpoint_views(self._raw_optimizers(), saving, sharded, self._final_optimizer_states)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_path(filepath)

    def on_exception(self, exception: BaseException) -> None:
        """A run that failed before its step engine existed (configure_model, setup) leaves no half-built
        process groups active for the next model built in this process; after setup they stay (a
        ``save_checkpoint`` after an interrupted fit still needs them)."""
        if self.engine is None and self.parallel_state is not None:
            self.parallel_state.destroy()
            self.parallel_state = None

    def teardown(self) -> None:
        """The process groups stay until the next ``setup_environment`` (or process exit), so
        ``trainer.save_checkpoint`` after ``fit`` can still write its shards."""
        if self.gradients is not None:
            self.gradients.close()
            self.gradients = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="Megatron-style tensor/pipeline/data/context/expert parallelism")
