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
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from ..cuda_graphs.config import CudaGraphConfig
from ..distributed import FullOptimizerView
from ..distributed.config import GradientConfig
from ..distributed.failure import FailureWatch
from ..distributed.gradients import GradientState
from ..engine import StepEngine
from ..engine.replicas import make_replicas_identical, seed_identically
from ..engine.train_step import TrainStep
from ..parallel import ParallelState
from ..parallel.config import ParallelConfig
from ..parallel.topology import DEFAULT_ORDER
from ..pipeline.shared_embeddings import check_tied_optimizer_settings
from ..quantization.float8 import Float8Config, enable_fp8, fp8_config
from ..transformer.compile import CompileLayers, check_compile_layers
from ..transformer.config import model_defaults
from .checkpoint_hooks import ShardedCheckpointHooks
from .evaluation import EvaluationHooks
from .last_stage import (Metrics, TrainingLastStage, call_hooks, check_automatic_optimization, check_model_kept,
                         check_per_token_accumulation, finish_step, training_outputs)
from .layer_setup import prepare_layers
from .loaders import prepare_dataloader
from .log_capture import DATA_PARALLEL_GROUP
from .metric_sync import sync_metrics_over_data_parallel
from .pipeline_report import report_pipeline_layout
from .precision import parallel_precision

_DDP: Any = DDPStrategy   # its methods are borrowed below (typed for a DDPStrategy self)


class MegatronStrategy(ShardedCheckpointHooks, EvaluationHooks, ParallelStrategy):
    """Tensor (+sequence), pipeline (1F1B / interleaved), data, context and expert parallelism.

    Args:
        tensor_model_parallel_size / pipeline_model_parallel_size / context_parallel_size /
        expert_model_parallel_size / expert_tensor_parallel_size: the layout; the data-parallel
            size is what is left of the world (``world / (tp·cp·pp)``).
        virtual_pipeline_model_parallel_size: local model chunks per pipeline rank (interleaved
            1F1B); build the model with ``lightning_megatron.pipeline.VirtualChunks``.
        order: rank order of the axes, fastest first (seed 001).
        sequence_parallel: shard activations outside tensor-parallel regions along the sequence.
        tp_comm_overlap: with sequence parallelism, overlap its all-gathers and reduce-scatters with the linear
            layers' GEMMs (a ring of chunks, ``tensor_parallel/comm_overlap.py``); not with fp8 or ``"zb-h1"``.
        micro_batch_size: samples per micro-batch (the per-rank batch a multiple of it; ``None``: the batch).
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
            the background and wait at the next forward of the module holding them (a transformer
            layer once for all of its own, outside its compiled bodies). Parameters are current
            between steps only after ``strategy.finish_param_sync()`` (checkpoints, evaluation and
            the end of fit call it; a callback reading weights must call it too).
        fp8: train the linear layers in float8 through torchao: ``"tensorwise"``, ``"rowwise"`` or a
            ``lightning_megatron.quantization.float8.Float8Config`` (``None``: off); needs ``pip install
            'lightning-megatron[fp8]'`` and a GPU of compute capability >= 8.9. Tensorwise: weights cast
            once a step (2 bytes an element; ``Float8Config(cache_weights=False)``: in every call).
        calculate_per_token_loss: ``training_step`` returns ``{"loss": <sum of token losses>, "num_tokens":
            <their count>}`` and the gradients are divided by the global batch's token count: one process's
            per-token mean however the labelled tokens spread over micro-batches, data and context ranks.
        compile_layers: ``torch.compile`` each ``TransformerLayer`` (``transformer/compile.py``): True, False,
            ``"auto"`` (default: CUDA, cp = 1, layers with work enough, no full graph) or ``torch.compile`` keywords.

    ``overlap_grad_reduce``, ``bucket_size``, ``grad_reduce_in_fp32`` or the distributed optimizer put gradients in
    buffers (``param.main_grad``); without them they stay in ``.grad``, reduced by one coalesced all-reduce.
    """

    strategy_name = "megatron"

    def __init__(self, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size: Optional[int] = None, context_parallel_size: int = 1,
                 expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                 order: str = DEFAULT_ORDER, sequence_parallel: bool = False,
                 micro_batch_size: Optional[int] = None, tp_comm_overlap: bool = False,
                 microbatch_group_size_per_vp_stage: Optional[int] = None, pipeline_schedule: str = "1f1b",
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: str = "popen", cuda_graph: Optional[str] = None,
                 cuda_graph_scope: Union[str, List[str]] = "layer", cuda_graph_warmup_steps: int = 1,
                 cuda_graph_backend: str = "cuda",
                 overlap_grad_reduce: bool = False, bucket_size: Optional[int] = None,
                 grad_reduce_in_fp32: bool = False, use_distributed_optimizer: bool = False,
                 overlap_param_gather: bool = False, fp8: Union[None, str, Float8Config] = None,
                 calculate_per_token_loss: bool = False, compile_layers: CompileLayers = "auto",
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
            micro_batch_size, microbatch_group_size_per_vp_stage, pipeline_schedule, tp_comm_overlap)
        self.gradient_config = GradientConfig(overlap_grad_reduce, bucket_size, grad_reduce_in_fp32,
                                              use_distributed_optimizer, overlap_param_gather)
        self.graph_config = CudaGraphConfig(cuda_graph, cuda_graph_scope, cuda_graph_warmup_steps, cuda_graph_backend)
        self.graph_config.check_with(self.gradient_config)
        self.fp8 = fp8_config(fp8)   # validated here; torchao and the GPU are checked at setup
        self.calculate_per_token_loss = bool(calculate_per_token_loss)
        self.compile_layers = check_compile_layers(compile_layers)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r} is not one of 'popen', 'spawn', 'fork', 'forkserver'.")
        self.engine: Optional[StepEngine] = None          # runs the steps (built in setup)
        self.gradients: Optional[GradientState] = None    # where the gradients live (built in setup when fitting)
        self.train_step: Optional[TrainStep] = None       # the step protocol over both (fitting)
        self.metrics: Optional[Metrics] = None            # torchmetrics objects kept equal over pipeline stages
        self._final_optimizer_states: Dict[int, FullOptimizerView] = {}    # gathered at the end of fit
        self._process_group_backend = process_group_backend
        self._timeout, self._start_method = timeout, start_method
        self.num_nodes = 1
        self.parallel_state: Optional[ParallelState] = None
        self.failure_watch = FailureWatch()   # a failed rank ends every rank (NCCL; started with the groups)
        self._accumulating = False   # inside Lightning's block_backward_sync: this batch does not end the window

    # -- Lightning plumbing --------------------------------------------------------------------------

    # Lightning's own (DDPStrategy's, borrowed rather than inherited: DDPStrategy would wrap the model in DDP)
    root_device = _DDP.root_device
    num_processes = _DDP.num_processes
    process_group_backend = _DDP.process_group_backend
    set_world_ranks = _DDP.set_world_ranks
    model_to_device = _DDP.model_to_device
    determine_ddp_device_ids = _DDP.determine_ddp_device_ids
    barrier = _DDP.barrier       # on the world group, as Lightning's callbacks expect
    broadcast = _DDP.broadcast

    is_distributed = True   # Lightning then adds a DistributedSampler (by data-parallel rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Data is sharded by data-parallel rank: tp/cp/pp peers read the same samples."""
        return {"num_replicas": self._state().dp_size, "rank": self._state().dp_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # torchrun/srun started the processes: the script launcher starts none, but first checks that
        # devices x num_nodes is the world the launcher made (else a bare IndexError on the extra ranks)
        if self.cluster_environment.creates_processes_externally or self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)  # type: ignore[arg-type]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        layout = self.parallel.layout(self.num_nodes * self.num_processes)   # pure: the same error on every rank
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
        self.failure_watch.start()
        seed_identically(self.parallel_state, self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.precision_plugin = parallel_precision(self.precision_plugin, None)   # checked before any work
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_automatic_optimization(self.lightning_module)
            check_per_token_accumulation(self.calculate_per_token_loss, trainer.accumulate_grad_batches)
        enable_fp8(self.lightning_module, self.fp8)   # the model exists (configure_model), the optimizer not yet
        prepare_layers(self.lightning_module, self.compile_layers, self.root_device, self._state().cp_size,
                       self.graph_config.cuda_graph)
        report_pipeline_layout(self.lightning_module, self._state())
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        make_replicas_identical(self.model, self._state())
        sync_metrics_over_data_parallel(self.model, self._state())
        self.metrics = Metrics(self.lightning_module, self._state())
        if fitting:
            self.setup_optimizers(trainer)
            check_tied_optimizer_settings(self.model.named_parameters(), self._raw_optimizers(), self._state().pp_size)
            self._close_step_machinery()
            self._final_optimizer_states = {}
            # after the optimizers exist: the distributed optimizer re-points them at its shards
            self.gradients = GradientState(list(self.model.parameters()), self._state(), self.gradient_config,
                                           optimizers=self._raw_optimizers(), modules=[self.model],
                                           device=self.root_device)
        self.precision_plugin = parallel_precision(self.precision_plugin, self.gradients)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.engine is not None:   # validate/test after fit
            self.engine.close()
        self.engine = StepEngine(self.lightning_module, self._state(), device=self.root_device,
            micro_batch_size=self.parallel.micro_batch_size, pipeline_schedule=self.parallel.pipeline_schedule,
            microbatch_group_size_per_vp_stage=self.parallel.microbatch_group_size_per_vp_stage,
            calculate_per_token_loss=self.calculate_per_token_loss, **dataclasses.asdict(self.graph_config))
        self.train_step = None if self.gradients is None else TrainStep(self.engine, self.gradients, [self.model])

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs inside: models built there take the strategy's ``sequence_parallel``; one
        that rebuilds the model an earlier run of the module trained is refused."""
        module = self.lightning_module
        before = {id(p) for p in module.parameters()} if module is not None else set()
        with model_defaults(**self.parallel.model_defaults()):
            yield
        if module is not None:
            check_model_kept(module, before)

    def _state(self) -> ParallelState:
        if self.parallel_state is None:
            raise RuntimeError("the megatron strategy's process groups do not exist yet (before setup_environment).")
        return self.parallel_state

    # -- the training step -----------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the whole schedule, forward and backward of every micro-batch. ``on_before_backward``
        is called per micro-batch on the last pipeline stage with the loss about to be backpropagated
        (divided by ``accumulate_grad_batches``, before loss scaling); ``on_after_backward`` once, when
        the gradients are handed back to Lightning."""
        module, train_step = self.lightning_module, self.train_step
        assert module is not None and train_step is not None
        assert self.gradients is not None and self.metrics is not None
        accumulate = module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        capture = self.metrics.capture(module, passthrough=self.graph_config.cuda_graph != "full")
        last_stage = TrainingLastStage(module, capture, args[1:], kwargs, scaler, self.calculate_per_token_loss)
        # MoE balancing losses inject their gradient inside backward: they get the main loss's factor
        result = train_step.run(args[0], last_stage, window_start=args[1] % accumulate == 0,
                                window_end=not self._accumulating, step_context=self.precision_plugin.train_step_context,
                                aux_loss_scale=(scaler.get_scale() if scaler is not None else 1.0) / accumulate,
                                extras=last_stage.extras)
        self.gradients.hide()   # Lightning zeroes gradients between training_step and backward: keep them away
        return training_outputs(finish_step(module, result, self.metrics, self.root_device), result)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran every backward inside ``training_step``: hand its gradients back."""
        assert self.gradients is not None and self.lightning_module is not None
        self.gradients.expose()
        call_hooks(self.lightning_module.trainer, "on_after_backward")
        return closure_loss

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's signal that this batch accumulates (the window goes on): reduce only at its end."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The user's optimizer steps (on its shards); then the step's post-optimizer obligations."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.train_step is not None
        self.train_step.after_optimizer_step()
        return out

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm as one process computes it (a collective: every rank, between backward
        and the optimizer step); Lightning's ``grad_norm(module)`` sees this rank's shards only."""
        if self.gradients is None:
            raise RuntimeError("strategy.grad_norm() reads the gradients of a training step: call it while fitting, "
                               "e.g. in on_before_optimizer_step.")
        return self.gradients.norm([p for opt in self._raw_optimizers() for group in opt.param_groups
                                    for p in group["params"]], norm_type)

    def finish_param_sync(self) -> None:
        """Wait for ``overlap_param_gather``'s all-gathers before reading parameters between steps (callbacks)."""
        if self.gradients is not None:
            self.gradients.finish_param_sync()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """A user's DistributedSampler must shard by data-parallel rank (checked on every rank, raised on every
        rank); training loaders resume mid-epoch exactly (Lightning alone replays the epoch's batches)."""
        return prepare_dataloader(dataloader, self.lightning_module.trainer if self.lightning_module else None,
                                  self.distributed_sampler_kwargs, self.parallel.micro_batch_size,
                                  any_rank=lambda flag: self.reduce_boolean_decision(flag, all=False))

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if group is DATA_PARALLEL_GROUP:   # what the replayed logs sync over: this run's data-parallel group
            group = self._state().dp_group   # (the step combined them over cp already)
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- the end -------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Other ranks hear of the failure and this rank cannot hang (``distributed/failure.py``); a run that failed
        before its step engine existed leaves no half-built process groups for the next model built here."""
        self.failure_watch.report(exception)
        if self.engine is None and self.parallel_state is not None:
            self.parallel_state.destroy()
            self.parallel_state = None

    def _close_step_machinery(self) -> None:
        for owner in (self.gradients, self.engine):
            if owner is not None:
                owner.close()
        self.gradients = self.engine = self.train_step = None

    @override
    def teardown(self) -> None:
        """The process groups stay until the next ``setup_environment`` (or process exit), so
        ``trainer.save_checkpoint`` after ``fit`` can still write its shards."""
        self._close_step_machinery()
        self.failure_watch.stop()
        super().teardown()
