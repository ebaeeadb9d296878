"""One step of a parallel model, without Lightning: micro-batches → schedule → loss and logs.

``StepEngine.run(batch, last_stage, ...)`` cuts this data-parallel rank's batch into micro-batches
(after taking this rank's context-parallel share of each sequence), runs the pipeline schedule
(forward and, for training, backward of every micro-batch; ``last_stage(microbatch)`` on the last
stage returns a :class:`StageOutput`: the loss to backpropagate, the value to report and what it
logs), maybe replayed from CUDA graphs, and returns a :class:`StepResult`: the step's loss as one
process would report it (a device tensor, no host sync when there is one pipeline stage), the logged
values combined over micro-batches, stages and cp ranks (``engine/logs.py``), and the outputs of
forward-only steps.

Losses are per-rank means by default: micro-batches and data-parallel replicas are averaged, which
is one process's mean when every micro-batch weighs the same. With ``calculate_per_token_loss``
``last_stage`` returns a *sum* over tokens and its token count; nothing is divided during the
step, and the gradients must be multiplied by ``StepResult.grad_scale`` (dp·cp / global token
count, applied after the data-parallel average) -- exact for any mix of token counts.

Gradient reduction, clipping and the optimizer are ``TrainStep``'s (``engine/train_step.py``), the whole
step protocol a plain Python loop or the Lightning adapter drives.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..context_parallel import sequence_keys, split_for_context_parallel
from .activation_shapes import ActivationShapes, learning_enabled, signature
from .microbatches import batch_size_of, split_into_microbatches
from ..moe import TopKRouter, set_aux_loss_scale
from ..parallel import ParallelState
from ..parallel.config import check_pipeline_schedule
from ..parallel.heartbeat import HEARTBEAT
from ..tensor_parallel.random import get_rng_tracker
from ..pipeline import resolve_group_size, schedule_order
from ..pipeline.executor import forward_backward
from ..quantization.float8_weights import (armed_weight_casts, float8_weight_casts, install_refresh_hooks,
                                           ready_for_capture)
from .logs import (LogError, Logged, broadcast_from_last_stage, check_logged, combine_microbatches, combine_over,
                   raise_log_error)

# micro-batch -> StageOutput (or, for training, (loss to backpropagate, value to report[, token count]); for
# evaluation, the step's output)
LastStage = Callable[[Any], Any]


@dataclass
class StageOutput:
    """What the last stage's call returns for one micro-batch. Training: ``loss`` (to backpropagate),
    ``report`` (the value to report; default ``loss.detach()``) and, with per-token losses, ``num_tokens``
    (the micro-batch's count). Evaluation: ``output``. Both: ``logs``, ``{name: (scalar, op)}`` with op one
    of ``"mean"`` (weighted by samples), ``"sum"``, ``"max"``, ``"min"``, combined over the step."""

    loss: Optional[torch.Tensor] = None
    report: Optional[torch.Tensor] = None
    num_tokens: Any = None
    logs: Mapping[str, Any] = field(default_factory=dict)
    output: Any = None


def as_stage_output(out: Any, forward_only: bool) -> StageOutput:
    """A last-stage call's result as a :class:`StageOutput` (tuples for training, anything for evaluation)."""
    if isinstance(out, StageOutput):
        return out
    if forward_only:
        return StageOutput(output=out)
    if isinstance(out, tuple):
        return StageOutput(out[0], *out[1:])
    return StageOutput(loss=out)


@dataclass(frozen=True)
class StepResult:
    """What one step produced, on every rank.

    ``loss``: the mean of the reported per-micro-batch values over the global batch (a float32
    device scalar; ``None`` for forward-only steps); with per-token losses, the reported sums over
    the global token count. ``logs``: ``{name: (value, op)}``, each name the last stage logged, combined
    over micro-batches, stages and context-parallel ranks by its op (device scalars): this data-parallel
    rank's values (the driver reduces them over dp if it wants the global batch's: Lightning's ``sync_dist``).
    ``outputs``: the last stage's per-micro-batch outputs of a
    forward-only step (``None`` elsewhere). ``num_tokens``/``grad_scale``: per-token losses only, the
    global token count and the factor the data-parallel-averaged gradients must be multiplied by.
    ``extras``: what ``run``'s ``extras()`` gave on the last stage, on every rank (other stages: on the CPU).
    """

    loss: Optional[torch.Tensor]
    logs: Logged
    outputs: Optional[List[Any]]
    num_microbatches: int
    num_tokens: Optional[torch.Tensor] = None
    grad_scale: Optional[torch.Tensor] = None
    extras: Any = None


class _CaptureOnly:
    """The per-step Python callables of a full-graph step: a graph runs them at its capture only, so
    every call's are equal as far as the graph's signature is concerned."""

    def __init__(self, last_stage: LastStage, step_context: Callable[[], ContextManager[Any]],
                 no_sync: Optional[Callable[[], Any]], extras: Optional[Callable[[], Any]]) -> None:
        self.last_stage, self.step_context, self.no_sync = last_stage, step_context, no_sync
        self.extras = extras

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CaptureOnly)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<step callables, run at capture>"


@functools.lru_cache(maxsize=16)
def _schedule_order(num_microbatches: int, pp_size: int, pp_rank: int, chunks: int,
                    group_size: Optional[int]) -> tuple:
    """The order this rank runs its layers in: a pure function of integers, computed once per shape."""
    return tuple(schedule_order(num_microbatches, pp_size, pp_rank, chunks, group_size))


def pipeline_roots(module: nn.Module) -> List[Any]:
    """Outermost modules that take the previous stage's activation (``set_input_tensor``; typed Any: a
    protocol that ``nn.Module``'s attribute typing cannot express)."""
    roots: List[tuple] = []
    for name, child in module.named_modules():
        if name and callable(getattr(child, "set_input_tensor", None)) and not any(
                name.startswith(r + ".") for r, _ in roots):
            roots.append((name, child))
    return [m for _, m in roots]


def activation_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the activations stages exchange: the parameters'."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


class StepEngine:
    """Runs steps of ``module`` (this rank's part of the model) under ``state``'s layout.

    - ``micro_batch_size``: samples per micro-batch (``None``: the batch is one micro-batch);
      ``microbatch_group_size_per_vp_stage``: the interleaved schedule's group size.
    - ``cuda_graph``: ``None``, ``"partial"`` (per-layer graphs replayed in schedule order) or ``"full"``
      (the whole forward-backward of a training step), captured after ``cuda_graph_warmup_steps``
      eager steps; ``cuda_graph_backend="eager"`` runs the capture bookkeeping without graphs.
    - ``calculate_per_token_loss``: ``last_stage`` returns ``(sum to backpropagate, sum to report,
      token count)`` (see the module doc).
    - ``pipeline_schedule``: ``"1f1b"`` (interleaved with virtual stages) or ``"zb-h1"`` (zero-bubble
      1F1B: weight gradients of the tensor-parallel linears deferred into the bubbles; one chunk, eager
      steps in high precision: no CUDA graphs, no float8).
    """

    def __init__(self, module: nn.Module, state: ParallelState, *, device: torch.device,
                 micro_batch_size: Optional[int] = None, microbatch_group_size_per_vp_stage: Optional[int] = None,
                 cuda_graph: Optional[str] = None, cuda_graph_scope: Any = "layer", cuda_graph_warmup_steps: int = 1,
                 cuda_graph_backend: str = "cuda", calculate_per_token_loss: bool = False,
                 pipeline_schedule: str = "1f1b") -> None:
        self.module, self.state, self.device = module, state, device
        self.pipeline_schedule = _check_schedule(pipeline_schedule, module, state, cuda_graph)
        self.per_token = calculate_per_token_loss
        self.micro_batch_size = micro_batch_size
        self.group_size = microbatch_group_size_per_vp_stage
        self.chunks = state.virtual_pipeline_size or 1
        self.roots = pipeline_roots(module)
        self.stage_dtype = activation_dtype(module)
        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]   # found once, set every step
        # float8 weights cast once per schedule, not per micro-batch: by their layers' pre-hooks (installed before any
        # graph is built: the per-layer graphs call the pre-hooks of the modules they replay)
        self.weight_casts = float8_weight_casts(module)
        self.cast_hooks = install_refresh_hooks(module) if self.weight_casts else []
        self.is_last_stage = state.is_pipeline_last_stage(ignore_virtual=True)
        self.cuda_graph = cuda_graph
        self.partial_graphs: Any = None
        self.full_graph: Any = None
        self.activation_shapes = ActivationShapes()   # exchanged without headers once learned (activation_shapes.py)
        self.learn_shapes = learning_enabled()
        if cuda_graph is not None:
            self._build_graphs(cuda_graph_scope, cuda_graph_warmup_steps, cuda_graph_backend)

    def _build_graphs(self, scope: Any, warmup_steps: int, backend: str) -> None:
        if backend == "cuda" and self.device.type != "cuda":
            raise ValueError(f"cuda_graph={self.cuda_graph!r} needs CUDA GPUs (accelerator='gpu'); drop cuda_graph "
                             "on CPUs.")
        from ..cuda_graphs import FullCudaGraphWrapper, PartialCudaGraphs, layer_chunks

        tracker = get_rng_tracker(self.state)
        if self.cuda_graph == "full":
            params = [p for p in self.module.parameters() if p.requires_grad]
            self.full_graph = FullCudaGraphWrapper(self._graphed_step, params=params, warmup_steps=warmup_steps,
                                                   rng_tracker=tracker, backend=backend)
        else:
            self.partial_graphs = PartialCudaGraphs(layer_chunks(self.module, self.chunks, scope), scope=scope,
                                                    warmup_steps=warmup_steps, rng_tracker=tracker, backend=backend)

    # -- the step ----------------------------------------------------------------------------------
    def run(self, batch: Any, last_stage: LastStage, *, forward_only: bool = False,
            step_context: Callable[[], ContextManager[Any]] = torch.enable_grad,
            no_sync: Optional[Callable[[], Any]] = None, aux_loss_scale: float = 1.0,
            extras: Optional[Callable[[], Any]] = None) -> StepResult:
        """One step over ``batch``. ``last_stage(microbatch)`` runs on the last pipeline stage inside
        ``step_context()``: for training it returns ``(loss to backpropagate, value to report)`` (and
        the token count, with per-token losses), for ``forward_only`` whatever the step outputs.
        ``no_sync``: the gradient buffers' context for every backward but the last. ``aux_loss_scale``:
        the factor of the backpropagated loss (loss scale / accumulation) that MoE balancing losses must
        share. ``extras()``: called on the last stage after its micro-batches (inside a full-step graph: at
        the capture, its tensors then being the graph's outputs); tensors, dicts and lists, handed to every
        rank as ``StepResult.extras`` (under pipeline parallelism through the host: one sync, only when it
        returns something)."""
        HEARTBEAT.begin("evaluation batch" if forward_only else "training batch")   # for the hang detector
        if self.full_graph is not None and not forward_only:
            core = self.full_graph(batch, _CaptureOnly(last_stage, step_context, no_sync, extras),
                                   aux_loss_scale=aux_loss_scale)
        else:
            core = self._schedule(batch, last_stage, forward_only, step_context, no_sync, aux_loss_scale,
                                  extras=extras)
        HEARTBEAT.at("the step's loss and logs to every rank", waiting=True)
        result = self._result(core, forward_only)
        if forward_only:   # a training step goes on in TrainStep (gradients), which ends it
            HEARTBEAT.end()
        return result

    def _graphed_step(self, batch: Any, callables: _CaptureOnly, aux_loss_scale: float) -> Dict[str, Any]:
        """What a full-step graph holds: every micro-batch's forward and backward on this rank (the
        callables run at the capture only; the graph returns the reported loss and logs as tensors)."""
        core = self._schedule(batch, callables.last_stage, False, callables.step_context, callables.no_sync,
                              aux_loss_scale, in_graph=True, extras=callables.extras)
        return {"reported": core["reported"], "logs": core["logs"], "outputs": None,
                "num_microbatches": core["num_microbatches"], "log_error": core["log_error"],
                "extras": core["extras"]}

    def _schedule(self, batch: Any, last_stage: LastStage, forward_only: bool,
                  step_context: Callable[[], ContextManager[Any]], no_sync: Optional[Callable[[], Any]],
                  aux_loss_scale: float, in_graph: bool = False,
                  extras: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
        state, module = self.state, self.module
        if state.cp_size > 1:   # this rank's load-balanced share of every sequence (chunks i, 2cp-1-i)
            batch = split_for_context_parallel(batch, state.cp_size, state.cp_rank, seq_dim=1,
                                               keys=sequence_keys(batch))   # per-sample vectors stay whole
        # evaluation keeps every sample of a ragged last batch (a smaller last micro-batch, logs weighted by size)
        microbatches = split_into_microbatches(batch, self.micro_batch_size, allow_smaller_last=forward_only)
        sizes = [batch_size_of(m) or 1 for m in microbatches]
        if self.chunks > 1:
            resolve_group_size(len(microbatches), state.pp_size, self.chunks, self.group_size)
        roots = self.roots
        results: List[Any] = []
        logged: List[Logged] = []
        weights: List[float] = []
        log_error: List[LogError] = []
        shapes: List[tuple] = []

        # activation shapes (``activation_shapes.py``): learned by a step with headers, then exchanged without; a
        # full-step graph needs them (nothing may be read on the host inside it), so its eager warm-up learns them
        # whatever LIGHTNING_MEGATRON_PIPELINE_SHAPES says
        use_learned = state.pp_size > 1 and (self.learn_shapes or in_graph)
        key = signature(microbatches) if use_learned else None
        known = self.activation_shapes.known(key) if key is not None else None
        record_shapes = key is not None and known is None

        def step(microbatch: Any, _chunk: Any, ctx: Any) -> Any:
            for root in roots:
                root.set_input_tensor(ctx.input_tensor)
            if record_shapes and ctx.input_tensor is not None:
                shapes.append(tuple(ctx.input_tensor.shape))
            with step_context():
                if not ctx.is_last_stage:
                    activation = module(microbatch)
                    if record_shapes:
                        shapes.append(tuple(activation.shape))
                    return activation
                out = as_stage_output(last_stage(microbatch), forward_only)
            try:   # raised on every rank after the step's collectives, not here on the last stage alone
                logged.append(check_logged(out.logs))
                weights.append(float(sizes[ctx.microbatch_id]))
            except (TypeError, ValueError) as err:
                log_error[:] = log_error or [(type(err).__name__, str(err))]
            if forward_only:
                results.append(out.output)
                return torch.zeros(()), None
            if out.loss is None:
                raise TypeError("a training step's last stage must return the loss to backpropagate "
                                "(StageOutput(loss=...) or a (loss, report) tuple); it returned none.")
            report = out.report if out.report is not None else out.loss.detach()
            if self.per_token:
                results.append(torch.stack([report.detach().float(), _token_count(out.num_tokens, self.device)]))
                return out.loss, None
            results.append(report)
            return out.loss, report

        if self.routers and not forward_only and self.per_token:
            # sums, later divided by the global token count (after the dp·cp average: the cp ranks'
            # partial balancing losses add up); each micro-batch's balancing loss weighs its tokens
            set_aux_loss_scale(self.routers, aux_loss_scale, per_token=True)
        elif self.routers and not forward_only:
            # ... and the executor's 1/micro-batches. Gradients are averaged over dp·cp, which makes the
            # user's per-rank mean losses one mean; the balancing losses are partial sums over the cp
            # ranks' shares of each sequence, so their gradients are multiplied back by cp.
            set_aux_loss_scale(self.routers, aux_loss_scale * state.cp_size / len(microbatches))
        # the float8 weights, cast once for all the micro-batches (inside a full-step graph: captured with them)
        graphed = (self.partial_graphs is not None or self.full_graph is not None) and not forward_only
        with armed_weight_casts(self.weight_casts, forward_only, graphed):
            if self.partial_graphs is not None and not forward_only:
                # per-layer graphs replay in exactly the order this schedule runs the layers
                with ready_for_capture(self.weight_casts):
                    self.partial_graphs.begin_step(_schedule_order(len(microbatches), state.pp_size, state.pp_rank,
                                                                   self.chunks, self.group_size))
            if known is not None:   # learned for these micro-batch shapes: no headers, no host sync
                shape_args: Dict[str, Any] = {"tensor_shape": known, "variable_seq_lengths": False}
            else:   # sent ahead (any length)
                shape_args = {"variable_seq_lengths": True}
            try:
                forward_backward(step, microbatches, [module] * self.chunks, num_microbatches=len(microbatches),
                                 dtype=self.stage_dtype, forward_only=forward_only, no_sync=no_sync,
                                 num_tokens=1 if self.per_token else None,   # per-token sums: nothing divided
                                 microbatch_group_size_per_vp_stage=self.group_size,
                                 pp_group=state.pp_group if state.pp_size > 1 else None, device=self.device,
                                 schedule=self.pipeline_schedule, **shape_args)
            finally:   # no received activation (nor its gradient) may outlive the step, in any virtual chunk
                for chunk in range(self.chunks):
                    with state.running_chunk(chunk) if self.chunks > 1 else contextlib.nullcontext():
                        for root in roots:
                            root.set_input_tensor(None)
        if key is not None and known is None:
            self.activation_shapes.learn(key, shapes, state.pp_group, self.device)
        reported = None
        if self.is_last_stage and not forward_only and results:
            if self.per_token:   # [sum of losses, token count] of this rank's micro-batches
                reported = torch.stack(results).sum(dim=0)
            else:
                reported = torch.stack([r.detach().float() for r in results]).mean()
        return {"reported": reported, "logs": combine_microbatches(logged, weights) if self.is_last_stage else {},
                "log_error": log_error[0] if log_error else None,
                "extras": extras() if extras is not None and self.is_last_stage else None,
                "outputs": results if self.is_last_stage and forward_only else None,
                "num_microbatches": len(microbatches)}

    def _result(self, core: Dict[str, Any], forward_only: bool) -> StepResult:
        """The last stage's loss and logs on every rank; the loss averaged over data-parallel replicas."""
        state = self.state
        loss = num_tokens = grad_scale = None
        if not forward_only:
            loss = core["reported"]
            if state.pp_size > 1:   # a tensor broadcast: no host sync
                if loss is None:
                    loss = torch.empty((2,) if self.per_token else (), dtype=torch.float32, device=self.device)
                dist.broadcast(loss, src=state.ranks("pp")[-1], group=state.pp_group)
            dp_cp = state.size("dp-cp")
            if dp_cp > 1:   # the mean over the global batch (or the global sums), as one process reports it
                loss = loss.clone()
                dist.all_reduce(loss, group=state.dp_cp_group)
                if not self.per_token:
                    loss /= dp_cp
            if self.per_token:
                num_tokens = loss[1]
                counted = num_tokens.clamp(min=1.0)   # no labelled token anywhere: zero loss and gradients
                loss, grad_scale = loss[0] / counted, dp_cp / counted
        logs, log_error, extras = core["logs"], core["log_error"], core["extras"]
        if state.pp_size > 1:
            logs, log_error, sent = broadcast_from_last_stage(logs, state, self.device, log_error, extras)
            extras = extras if self.is_last_stage else sent
        raise_log_error(log_error)   # after the step's collectives, on every rank
        if state.cp_size > 1:   # each cp rank logged from its share of the sequences: one value for them all
            logs = combine_over(logs, state.cp_group, state.cp_size)
        return StepResult(loss=loss, logs=logs, outputs=core["outputs"], num_microbatches=core["num_microbatches"],
                          num_tokens=num_tokens, grad_scale=grad_scale, extras=extras)

    def close(self) -> None:
        """Give back the per-layer graphs' hooks (the model runs eagerly again) and the float8 casts' hooks."""
        if self.partial_graphs is not None:
            self.partial_graphs.remove()
        for hook in self.cast_hooks:
            hook.remove()
        self.cast_hooks = []
        self.partial_graphs, self.full_graph = None, None


def _check_schedule(schedule: str, module: nn.Module, state: ParallelState, cuda_graph: Optional[str]) -> str:
    """``schedule`` if it runs with these settings, else one error naming what to drop."""
    check_pipeline_schedule(schedule, state.virtual_pipeline_size or 1)
    if schedule == "zb-h1":
        if cuda_graph is not None:
            raise ValueError(f"pipeline_schedule='zb-h1' cannot run with cuda_graph={cuda_graph!r}: the graphs replay "
                             "1F1B's order of whole backwards; drop cuda_graph or use pipeline_schedule='1f1b'.")
        if any(getattr(m, "float8", None) is not None for m in module.modules()):
            raise ValueError("pipeline_schedule='zb-h1' cannot run with fp8: the float8 linears compute their weight "
                             "gradient inside the backward; drop fp8 or use pipeline_schedule='1f1b'.")
    return schedule


def _token_count(count: Any, device: torch.device) -> torch.Tensor:
    """A micro-batch's token count (an int or a scalar tensor) as a float32 device scalar."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"num_tokens must be a scalar (the micro-batch's token count), got shape "
                             f"{tuple(count.shape)}.")
        return count.detach().reshape(()).float().to(device)   # a count computed on the host is moved once
    return torch.full((), float(count), dtype=torch.float32, device=device)   # a fill: capturable
