"""``Trainer(strategy="megatron")``: Megatron-style parallelism for an ordinary LightningModule.

This file speaks Lightning; everything it drives (process groups, schedules, gradient
reduction, clipping) lives below it and knows nothing of Lightning.

One training step (one Lightning batch per data-parallel rank and optimizer step): split the
batch into micro-batches, run the pipeline schedule (forward and backward of every micro-batch,
the user's ``training_step`` on the last stage), reduce gradients across the parallel groups,
then let Lightning clip and step. Lightning's own backward is a no-op: the schedule ran it.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Generator, List, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch import nn
from torch.distributed.constants import default_pg_timeout

from .checkpoint import load_rank_state, load_sharded, save_sharded
from .context_parallel import split_for_context_parallel
from .distributed import (DataParallelGrads, DistributedOptimizer, FullOptimizerView, clip_grad_norm,
                          default_bucket_size, finalize_model_grads, split_into_microbatches)
from .parallel import ParallelLayout, ParallelState
from .parallel.topology import DEFAULT_ORDER, check_size
from .moe import set_aux_loss_scale, update_expert_biases
from .pipeline import resolve_group_size, schedule_order
from .pipeline.executor import forward_backward
from .resumable_loader import ResumableLoader
from .rng_state import capture_rng_state, restore_rng_state
from .step_logging import StepLogCapture, broadcast_from_last_stage, replay
from .tensor_parallel.random import seed_tracker

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


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
                 overlap_param_gather: bool = False,
                 accelerator: Optional[Accelerator] = None, parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.tp = check_size("tensor_model_parallel_size", tensor_model_parallel_size)
        self.pp = check_size("pipeline_model_parallel_size", pipeline_model_parallel_size)
        self.cp = check_size("context_parallel_size", context_parallel_size)
        self.ep = check_size("expert_model_parallel_size", expert_model_parallel_size)
        self.etp = None if expert_tensor_parallel_size is None else check_size(
            "expert_tensor_parallel_size", expert_tensor_parallel_size)
        self.vpp = None if virtual_pipeline_model_parallel_size is None else check_size(
            "virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size={self.vpp} needs "
                             "pipeline_model_parallel_size >= 2; raise it or drop the virtual stages.")
        if micro_batch_size is not None:
            check_size("micro_batch_size", micro_batch_size)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r} is not one of 'popen', 'spawn', 'fork', 'forkserver'.")
        if cuda_graph not in (None, "partial", "full"):
            raise ValueError(f"cuda_graph={cuda_graph!r} is not one of None, 'partial', 'full'.")
        if cuda_graph == "full" and (use_distributed_optimizer or overlap_grad_reduce or grad_reduce_in_fp32):
            raise ValueError("cuda_graph='full' works with plain gradients: drop use_distributed_optimizer, "
                             "overlap_grad_reduce and grad_reduce_in_fp32, or use cuda_graph='partial'.")
        if cuda_graph is not None:
            check_size("cuda_graph_warmup_steps", cuda_graph_warmup_steps)
        if cuda_graph_backend not in ("cuda", "eager"):
            raise ValueError(f"cuda_graph_backend={cuda_graph_backend!r} is not 'cuda' or 'eager' (the capture "
                             "bookkeeping without graphs, for CPU tests).")
        self.cuda_graph, self.cuda_graph_scope = cuda_graph, cuda_graph_scope
        self.cuda_graph_warmup_steps, self.cuda_graph_backend = cuda_graph_warmup_steps, cuda_graph_backend
        self._graphs: Any = None
        self._full_graph: Any = None
        self._full_step_args: Any = None
        self._activation_shape: Optional[tuple] = None   # of the tensors stages exchange, once seen
        self._routers = False           # the model has MoE routers (set in setup)
        self._roots: List[nn.Module] = []     # modules taking the previous stage's activation (setup)
        self._stage_dtype = torch.float32     # dtype of the activations stages exchange (setup)
        self._aux_loss_scale = 1.0
        if bucket_size is not None:
            check_size("bucket_size", bucket_size)
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True gathers the distributed optimizer's shards; set "
                             "use_distributed_optimizer=True as well, or drop overlap_param_gather.")
        self.overlap_grad_reduce = overlap_grad_reduce
        self.bucket_size = bucket_size
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        self.grads: Optional[DataParallelGrads] = None                  # gradient buffers, when in use
        self.distributed_optimizer: Optional[DistributedOptimizer] = None
        self._final_optimizer_states: Dict[int, FullOptimizerView] = {}    # gathered at the end of fit
        self._layout: Optional[Dict[str, Any]] = None                   # sizes, for checkpoints
        self.order = order
        if sequence_parallel and self.tp == 1:
            rank_zero_warn("sequence_parallel=True does nothing with tensor_model_parallel_size=1 (it shards "
                           "activations over tensor-parallel ranks): turned off. Set "
                           "tensor_model_parallel_size >= 2 to use it.")
            sequence_parallel = False
        self.sequence_parallel = sequence_parallel
        self.micro_batch_size = micro_batch_size
        self.microbatch_group_size_per_vp_stage = microbatch_group_size_per_vp_stage
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.num_nodes = 1
        self.parallel_state: Optional[ParallelState] = None
        self._accumulating = False
        self._stashed_grads: List[Any] = []

    # -- Lightning plumbing --------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning then shards the data with a DistributedSampler (by data-parallel rank)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Data is sharded by data-parallel rank: tp/cp/pp peers read the same samples."""
        state = self._state()
        return {"num_replicas": state.dp_size, "rank": state.dp_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        world = self.num_nodes * self.num_processes
        # pure validation first: every rank raises the same error before any group exists
        layout = ParallelLayout(world, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp,
                                order=self.order)
        if self.vpp and self.vpp > 1 and self.micro_batch_size is None:
            raise ValueError("virtual_pipeline_model_parallel_size > 1 needs micro_batch_size: the interleaved "
                             "schedule needs at least pipeline_model_parallel_size micro-batches per step.")
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
        state = ParallelState(layout, timeout=self._timeout, virtual_pipeline_size=self.vpp)
        self._layout = {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp,
                        "ep": layout.ep, "etp": layout.etp, "order": layout.order, "vpp": self.vpp or 1}
        state.sequence_parallel = self.sequence_parallel
        self.parallel_state = state.activate()
        self._seed_identically()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _seed_identically(self) -> None:
        """Replicated activations need identical dropout on every tp rank: one seed for the world."""
        state = self._state()
        seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.long, device=self.root_device)
        dist.broadcast(seed, src=0)   # on the device NCCL needs, and read back from that same tensor
        seed = int(seed.item())
        torch.manual_seed(seed)
        seed_tracker(state.rng_tracker, seed, state.tp_rank, state.ep_rank, state.etp_rank)

    def setup(self, trainer: "L.Trainer") -> None:  # noqa: F821
        assert self.model is not None and self.accelerator is not None
        precision = trainer.precision
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(f"precision={precision!r} is not supported by the megatron strategy; use one of "
                             f"{list(SUPPORTED_PRECISION)}.")
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._make_replicas_identical()
        self._metrics_sync_over_data_parallel()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._setup_grad_buffers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_gradient_clipping()
        self._install_found_inf_sync()
        self._setup_cuda_graphs()
        from .moe import TopKRouter

        self._routers = any(isinstance(m, TopKRouter) for m in self.model.modules())
        # found once: the schedule needs them every micro-batch
        self._roots = self._pipeline_roots()
        self._stage_dtype = self._activation_dtype()

    def _setup_cuda_graphs(self) -> None:
        """``"partial"``: per-layer graphs (seed 003); ``"full"``: the whole forward-backward of a training
        step (seed 004); both captured after ``cuda_graph_warmup_steps`` eager steps."""
        if self.cuda_graph is None or self._graphs is not None or self._full_graph is not None:
            return
        if self.cuda_graph_backend == "cuda" and self.root_device.type != "cuda":
            raise ValueError(f"cuda_graph={self.cuda_graph!r} needs CUDA GPUs (accelerator='gpu'); drop cuda_graph "
                             "on CPUs.")
        from .cuda_graphs import FullCudaGraphWrapper, PartialCudaGraphs, layer_chunks

        state = self._state()
        if self.cuda_graph == "full":
            params = [p for p in self.lightning_module.parameters() if p.requires_grad]
            self._full_graph = FullCudaGraphWrapper(self._full_graph_step, params=params,
                                                    warmup_steps=self.cuda_graph_warmup_steps,
                                                    rng_tracker=state.rng_tracker, backend=self.cuda_graph_backend)
            return
        chunks = layer_chunks(self.lightning_module, state.virtual_pipeline_size or 1)
        self._graphs = PartialCudaGraphs(chunks, scope=self.cuda_graph_scope,
                                         warmup_steps=self.cuda_graph_warmup_steps,
                                         rng_tracker=state.rng_tracker, backend=self.cuda_graph_backend)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _state(self) -> ParallelState:
        if self.parallel_state is None:
            raise RuntimeError("the megatron strategy's process groups do not exist yet (before setup_environment).")
        return self.parallel_state

    @torch.no_grad()
    def _make_replicas_identical(self) -> None:
        """Copies of one parameter must start equal: broadcast from the first rank of each group."""
        state = self._state()
        for param in list(self.model.parameters()) + list(self.model.buffers()):
            expert = getattr(param, "expert_parallel", False)
            name = "edp" if expert else "dp-cp"
            if state.size(name) > 1:
                dist.broadcast(param.data, src=state.ranks(name)[0], group=state.group(name))
            if not expert and not getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
                dist.broadcast(param.data, src=state.ranks("tp")[0], group=state.tp_group)

    def _metrics_sync_over_data_parallel(self) -> None:
        """torchmetrics sync over data-parallel replicas only: tp/pp peers saw the same samples."""
        from torchmetrics import Metric

        group = self._state().dp_cp_group
        for module in self.model.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = group

    # -- gradient buffers and the distributed optimizer -----------------------------------------------

    @property
    def _uses_grad_buffers(self) -> bool:
        return (self.overlap_grad_reduce or self.use_distributed_optimizer or self.grad_reduce_in_fp32
                or self.bucket_size is not None)

    def _setup_grad_buffers(self) -> None:
        """Gradients into contiguous buffers (after the optimizers exist: the distributed optimizer
        re-points them at its shards)."""
        self._close_grad_buffers()
        self._final_optimizer_states = {}
        if not self._uses_grad_buffers:
            return
        state = self._state()
        shard = self.use_distributed_optimizer
        self.grads = DataParallelGrads(
            [p for p in self.model.parameters() if p.requires_grad],
            dense_group=state.dp_cp_group, expert_group=state.edp_group, divisor=state.size("dp-cp"),
            overlap_grad_reduce=self.overlap_grad_reduce,
            bucket_size=self.bucket_size or default_bucket_size(self.overlap_grad_reduce, state.size("dp-cp")),
            grad_reduce_in_fp32=self.grad_reduce_in_fp32, shard=shard,
            isolate=lambda p: state.pp_size > 1 and getattr(p, "shared_embedding", False))
        if shard and state.tp_size > 1:
            self._check_buffers_line_up_over_tp()
        if shard:
            self.distributed_optimizer = DistributedOptimizer(
                self.optimizers, self.grads, modules=[self.model], overlap_param_gather=self.overlap_param_gather)

    def _check_buffers_line_up_over_tp(self) -> None:
        """Sequence-parallel gradients are summed over tp after the reduce-scatter: each rank's shard
        must hold the same elements on every tp peer."""
        state = self._state()
        mine = torch.tensor([self.grads.signature()], dtype=torch.int64, device=self.root_device)
        everyone = [torch.empty_like(mine) for _ in range(state.tp_size)]
        dist.all_gather(everyone, mine, group=state.tp_group)
        if len({int(t) for t in everyone}) > 1:
            raise ValueError("use_distributed_optimizer=True needs the tensor-parallel ranks' parameters to have "
                             "the same shapes in the same order (their gradient buffers differ); build every tp "
                             "rank's model the same way, or set use_distributed_optimizer=False.")

    def _close_grad_buffers(self) -> None:
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.close()
        if self.grads is not None:
            self.grads.close()
        self.grads, self.distributed_optimizer = None, None

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers of ``overlap_param_gather``: call before reading parameters
        outside a forward between steps (e.g. in a callback); checkpoints and the end of fit do it."""
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.finish_param_sync()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The user's optimizer steps on its shards; then every rank's parameters are made whole again."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.gather_params()
        if self._routers:
            update_expert_biases(self.lightning_module)   # aux-loss-free balancing: after the step
        return out

    def on_train_end(self) -> None:
        """The process groups go with ``teardown``: keep the whole optimizer state (host memory) for a
        ``trainer.save_checkpoint`` after ``fit``."""
        self.finish_param_sync()
        if self.distributed_optimizer is not None:
            self._final_optimizer_states = {
                id(opt): FullOptimizerView.gather(self.distributed_optimizer, opt, keep_optimizer=False)
                for opt in self.distributed_optimizer.optimizers}

    # -- the training step -----------------------------------------------------------------------------

    def _pipeline_roots(self) -> List[nn.Module]:
        """Outermost modules that take the previous stage's activation (``set_input_tensor``)."""
        roots: List[nn.Module] = []
        for name, module in self.lightning_module.named_modules():
            if name and callable(getattr(module, "set_input_tensor", None)) and not any(
                    name.startswith(r + ".") for r, _ in roots):
                roots.append((name, module))
        return [m for _, m in roots]

    def _activation_dtype(self) -> torch.dtype:
        for param in self.lightning_module.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.float32

    def _run_schedule(self, batch: Any, run_last_stage: Callable[[Any], Any], forward_only: bool,
                      step_context: Callable[[], Any], passthrough_metrics: bool,
                      no_sync: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
        """The schedule over ``batch`` (maybe replayed from a full-iteration CUDA graph), then the
        step's loss and logs from the last stage on every rank."""
        state = self._state()
        module = self.lightning_module
        if self.cuda_graph == "full" and not forward_only:
            self._full_step_args = (run_last_stage, step_context, no_sync)   # read at capture only
            core = self._full_graph(batch)
        else:
            core = self._schedule_core(batch, run_last_stage, forward_only, step_context, passthrough_metrics,
                                       no_sync)
        is_last = state.is_pipeline_last_stage(ignore_virtual=True)
        reported = float(core["reported"]) if core["reported"] is not None else None
        packet = broadcast_from_last_stage({"loss": reported, "logs": core["logs"]}, state)
        replay(module, packet["logs"], self.root_device, state.dp_cp_group)
        loss = packet["loss"]
        if loss is not None and state.size("dp-cp") > 1:
            # the step's loss is the mean over the whole (global) batch, as one process reports it
            loss_tensor = torch.tensor([loss], dtype=torch.float64, device=self.root_device)
            dist.all_reduce(loss_tensor, group=state.dp_cp_group)
            loss = float(loss_tensor) / state.size("dp-cp")
        return {"loss": loss, "outputs": core["outputs"] if is_last else None}

    def _activation_shapes(self, forward_only: bool) -> Dict[str, Any]:
        """How stages learn the shape of what they receive: sent ahead (any length), or, inside a
        full-iteration graph (nothing may be read on the host there), the shape the eager warm-up
        steps exchanged, which static batches keep."""
        if self.cuda_graph == "full" and not forward_only and self._activation_shape is not None:
            return {"tensor_shape": self._activation_shape, "variable_seq_lengths": False}
        return {"variable_seq_lengths": True}

    def _full_graph_step(self, batch: Any) -> Dict[str, Any]:
        """What the full-iteration graph holds: every micro-batch's forward and backward on this rank.

        Python side effects (``self.log``, the user's ``training_step``) run at the capture only; the
        graph returns the loss and logged values as tensors that each replay refreshes.
        """
        run_last_stage, step_context, no_sync = self._full_step_args
        core = self._schedule_core(batch, run_last_stage, False, step_context, False, no_sync)
        return {"reported": core["reported"], "logs": core["logs"], "outputs": None}

    def _schedule_core(self, batch: Any, run_last_stage: Callable[[Any], Any], forward_only: bool,
                       step_context: Callable[[], Any], passthrough_metrics: bool,
                       no_sync: Optional[Callable[[], Any]]) -> Dict[str, Any]:
        state = self._state()
        module = self.lightning_module
        if state.cp_size > 1:   # this rank's load-balanced share of every sequence (chunks i, 2cp-1-i)
            batch = split_for_context_parallel(batch, state.cp_size, state.cp_rank, seq_dim=1)
        microbatches = split_into_microbatches(batch, self.micro_batch_size)
        chunks = state.virtual_pipeline_size or 1
        if chunks > 1:
            resolve_group_size(len(microbatches), state.pp_size, chunks, self.microbatch_group_size_per_vp_stage)
        roots = self._roots
        capture = StepLogCapture(module, passthrough_metrics)
        results: List[Any] = []

        def step(microbatch: Any, _chunk: Any, ctx: Any) -> Any:
            for root in roots:
                root.set_input_tensor(ctx.input_tensor)
            if ctx.input_tensor is not None:
                self._activation_shape = tuple(ctx.input_tensor.shape)
            with step_context():
                if not ctx.is_last_stage:
                    activation = module(microbatch)
                    self._activation_shape = tuple(activation.shape)
                    return activation
                with capture.microbatch():
                    out = run_last_stage(microbatch)
            loss, reported = _loss_of(out, forward_only)
            results.append(out if forward_only else reported)
            return loss, reported

        if self._routers and not forward_only:
            # ... and the executor's 1/micro-batches. Gradients are averaged over dp·cp, which makes the
            # user's per-rank mean losses one mean; the balancing losses are partial sums over the cp
            # ranks' shares of each sequence, so their gradients are multiplied back by cp.
            set_aux_loss_scale(module, self._aux_loss_scale * state.cp_size / len(microbatches))
        if self._graphs is not None and not forward_only:
            # per-layer graphs replay in exactly the order this schedule runs the layers
            self._graphs.begin_step(schedule_order(len(microbatches), state.pp_size, state.pp_rank, chunks,
                                                   self.microbatch_group_size_per_vp_stage))
        output = forward_backward(step, microbatches, [module] * chunks, num_microbatches=len(microbatches),
                                  dtype=self._stage_dtype, **self._activation_shapes(forward_only),
                                  forward_only=forward_only, no_sync=no_sync,
                                  microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
                                  pp_group=state.pp_group if state.pp_size > 1 else None,
                                  device=self.root_device)
        is_last = state.is_pipeline_last_stage(ignore_virtual=True)
        reported = None
        if is_last and not forward_only and results:
            reported = torch.stack([r.float() for r in results]).mean()
        return {"reported": reported, "logs": capture.averaged() if is_last else {},
                "outputs": results if is_last else None}

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the whole schedule, forward and backward of every micro-batch. ``on_before_backward``
        is called per micro-batch on the last pipeline stage with the loss about to be backpropagated
        (divided by ``accumulate_grad_batches``, before loss scaling); ``on_after_backward`` once, when
        the gradients are handed back to Lightning."""
        from lightning.pytorch.trainer import call

        module = self.lightning_module
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)

        # MoE balancing losses inject their gradient inside backward: give it the main loss's factor
        self._aux_loss_scale = (scaler.get_scale() if scaler is not None else 1.0) / accumulate

        def last_stage(microbatch: Any) -> Any:
            out = module.training_step(microbatch, *args[1:], **kwargs)
            loss = _extract_loss(out)
            backward = loss / accumulate
            # Lightning's hook, just before this micro-batch's backward (on the last pipeline stage)
            call._call_callback_hooks(trainer, "on_before_backward", backward)
            call._call_lightning_module_hook(trainer, "on_before_backward", backward)
            return (scaler.scale(backward) if scaler is not None else backward), loss.detach()

        if self.grads is not None:
            return self._training_step_into_buffers(last_stage, *args)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if args[1] % accumulate == 0:   # first batch of an accumulation window: start from zero
            for param in params:
                param.grad = None
        done = self._run_schedule(args[0], last_stage, False, self.precision_plugin.train_step_context,
                                  passthrough_metrics=self._state().pp_size == 1)
        if not self._accumulating:
            finalize_model_grads([self.model], self._state())
        # Lightning zeroes gradients between training_step and backward: keep ours out of its reach
        self._stashed_grads = [(param, param.grad) for param in params]
        for param in params:
            param.grad = None
        return {"loss": torch.tensor(done["loss"], device=self.root_device)}

    def _training_step_into_buffers(self, last_stage: Callable[[Any], Any], *args: Any) -> Any:
        """The step with gradient buffers: accumulate in ``main_grad``; reduce (maybe overlapped with the
        backward) only in the last micro-batch of the last batch of an accumulation window."""
        grads = self.grads
        self._detach_grads()   # an attached .grad would make autograd accumulate into main_grad twice
        if args[1] % self.lightning_module.trainer.accumulate_grad_batches == 0:
            grads.zero_grad()
        with grads.no_sync() if self._accumulating else nullcontext():
            done = self._run_schedule(args[0], last_stage, False, self.precision_plugin.train_step_context,
                                      passthrough_metrics=self._state().pp_size == 1, no_sync=grads.no_sync)
        if not self._accumulating:
            finalize_model_grads([self.model], self._state(), grads=grads)
        self._detach_grads()   # Lightning zeroes gradients before backward (maybe in place): keep them away
        return {"loss": torch.tensor(done["loss"], device=self.root_device)}

    def _detach_grads(self) -> None:
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.detach_grads()
        if self.grads is not None:
            self.grads.detach()

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran every backward inside ``training_step``: hand its gradients back."""
        from lightning.pytorch.trainer import call

        if self.distributed_optimizer is not None:
            self.distributed_optimizer.attach_grads()
        elif self.grads is not None:
            self.grads.attach()
        for param, grad in self._stashed_grads:
            param.grad = grad
        self._stashed_grads = []
        trainer = self.lightning_module.trainer
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
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
        done = self._run_schedule(args[0], lambda mb: getattr(module, hook)(mb, *args[1:], **kwargs), True,
                                  context, passthrough_metrics=self._state().pp_size == 1)
        outputs = done["outputs"]
        if outputs is None:
            return None
        return outputs[0] if len(outputs) == 1 else _concat(outputs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._eval_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)
        return broadcast_from_last_stage(_to_cpu(out), self._state())   # rank 0 holds the first stage

    def process_dataloader(self, dataloader: Any) -> Any:
        """Training loaders resume mid-epoch exactly (Lightning alone replays the epoch's batches)."""
        from lightning.pytorch.trainer.states import RunningStage
        from torch.utils.data import DataLoader

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None

        if trainer is not None and trainer.state.stage == RunningStage.TRAINING and isinstance(dataloader, DataLoader):
            return ResumableLoader(dataloader)
        return dataloader

    def on_predict_end(self) -> None:
        """Predictions of every data-parallel rank, put back in dataset order on every rank.

        Lightning's predict sampler gives data-parallel rank r the samples r, r+dp, r+2dp, ...
        (padded by repeating the first ones): interleaving the ranks' outputs and trimming the padding
        restores the order. Outputs that are not tensors with a batch dimension stay per rank.
        """
        state = self._state()
        loop = self.lightning_module.trainer.predict_loop
        if state.dp_size == 1 or not loop.return_predictions:
            return
        for index, batches in enumerate(loop._predictions):
            if not batches or not all(isinstance(b, torch.Tensor) and b.dim() for b in batches):
                continue
            local = torch.cat([b.cpu() for b in batches])
            gathered: List[Any] = [None] * state.dp_size
            dist.all_gather_object(gathered, local, group=state.dp_group)
            loaders = self.lightning_module.trainer.predict_dataloaders
            total = len((loaders[index] if isinstance(loaders, (list, tuple)) else loaders).dataset)
            ordered = torch.stack(gathered, dim=1).flatten(0, 1)[:total]
            per_batch = batches[0].shape[0] * state.dp_size
            batches[:] = list(ordered.split(per_batch))

    # -- gradients -------------------------------------------------------------------------------------

    def _install_gradient_clipping(self) -> None:
        """Lightning clips per process; a parallel model must clip by the norm of the whole model."""
        state = self._state()
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grad_norm(params, float(clip_val), state, sharded=self.distributed_optimizer is not None,
                           device=self.root_device)

        def clip_grad_by_value(optimizer: Any, clip_val: Union[int, float]) -> None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_value_(params, clip_val)   # elementwise: no communication needed

        plugin.clip_grad_by_norm = clip_grad_by_norm
        plugin.clip_grad_by_value = clip_grad_by_value

    def _install_found_inf_sync(self) -> None:
        """16-mixed: every rank must skip the same steps, so overflow found anywhere counts everywhere."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None:
            return
        unscale = scaler.unscale_

        def unscale_and_agree(optimizer: Any) -> None:
            unscale(optimizer)
            found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for tensor in found.values():
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX)

        scaler.unscale_ = unscale_and_agree

    # -- collectives with Lightning's semantics on the world group -------------------------------------

    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

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
        if checkpoint.get(_SHARDED_KEY):
            return   # load_checkpoint already read every shard into place
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.distributed_optimizer is not None:
            self.distributed_optimizer.reload_main_params()

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        return {}   # save_checkpoint writes the optimizer state shard by shard

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not checkpoint.get(_SHARDED_KEY):
            raise ValueError("the megatron strategy loads its own sharded checkpoint folders (load_checkpoint) only.")
        # load_checkpoint already read every optimizer's state into place

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A sharded folder written by every rank, with or without the distributed optimizer; it resumes at
        any layout."""
        path = self.broadcast(str(filepath))
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        save_sharded(path, [self.lightning_module], self._checkpoint_optimizers(saving=True), extra_state=checkpoint,
                     rank_state=capture_rng_state(self._state().rng_tracker))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """A sharded folder (from any layout, with or without the distributed optimizer), read into place."""
        return self._load_sharded(str(self.broadcast(str(checkpoint_path))))

    def _load_sharded(self, path: str) -> Dict[str, Any]:
        """Model and (when fitting) optimizer states read shard by shard into this layout, then the
        trainer's own state; RNG streams come back when the layout is the one that saved them."""
        trainer = self.lightning_module.trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = self._checkpoint_optimizers(saving=False) if fitting else None
        extra = load_sharded(path, [self.lightning_module], optimizers,
                             strict=self.lightning_module.strict_loading) or {}
        rng = load_rank_state(path)
        if rng is not None:
            restore_rng_state(rng, self._state().rng_tracker)
        extra = dict(extra)
        extra[_SHARDED_KEY] = True
        extra.setdefault("state_dict", {})
        extra["optimizer_states"] = [{} for _ in self.optimizers] if fitting else []
        return extra

    def _raw_optimizers(self) -> List[Any]:
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]

    def _checkpoint_optimizers(self, saving: bool) -> List[Any]:
        """What the sharded checkpoint reads and writes: each optimizer as the plain optimizer over the
        model's parameters (under the distributed optimizer a view gathered over data parallelism), so
        one format reshards TP/PP/EP/DP with or without the distributed optimizer."""
        out = []
        for optimizer in self._raw_optimizers():
            dist_opt = self.distributed_optimizer
            if dist_opt is not None and optimizer in dist_opt.optimizers:
                out.append(FullOptimizerView.gather(dist_opt, optimizer) if saving
                           else FullOptimizerView.to_load(dist_opt, optimizer))
            elif saving and id(optimizer) in self._final_optimizer_states:   # after fit: gathered at its end
                out.append(self._final_optimizer_states[id(optimizer)])
            else:
                out.append(optimizer)
        return out

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def teardown(self) -> None:
        """The process groups stay until the next ``setup_environment`` (or process exit), so
        ``trainer.save_checkpoint`` after ``fit`` can still write its shards."""
        self._close_grad_buffers()
        if self._graphs is not None:
            self._graphs.remove()
            self._graphs = None
        self._full_graph = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="Megatron-style tensor/pipeline/data/context/expert parallelism")


_SHARDED_KEY = "megatron_sharded"


def _extract_loss(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError("training_step must return the loss (a scalar tensor) or a dict with a 'loss' key under "
                        f"the megatron strategy, got {type(out).__name__}.")
    return loss


def _loss_of(out: Any, forward_only: bool) -> Any:
    """What the executor needs from the last stage: (loss for backward, what to report)."""
    if forward_only:
        return torch.zeros(()), None
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return type(obj)({k: _to_cpu(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _concat(outputs: List[Any]) -> Any:
    """Per-micro-batch outputs joined back into one batch's output."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if first.dim() else torch.stack(outputs).mean()
    if isinstance(first, Mapping):
        return type(first)({k: _concat([o[k] for o in outputs]) for k in first})
    return outputs
