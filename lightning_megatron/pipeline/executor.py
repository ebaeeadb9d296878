"""Run forward and backward of every micro-batch over this rank's model chunks, in schedule order.

One engine serves the schedules, since ``schedule_steps`` already says what runs when:
no pipelining (``pp_size == 1``: F,B,F,B... = gradient accumulation), 1F1B (one chunk),
interleaved 1F1B (several chunks) and zero-bubble 1F1B (``schedule="zb-h1"``, ``zero_bubble.py``:
a backward computes input gradients only, and a later weight step the weight gradients its
deferring linears left in the micro-batch's queue, ``tensor_parallel/deferred_wgrad.py``).
``comm_plan`` pairs every send with its receive, so the
engine just walks its rounds: run the round's step, then exchange with the neighbours.

The caller's ``forward_step_fn(microbatch, model_chunk, ctx)`` runs one chunk on one
micro-batch. The activation received from the previous stage arrives as ``ctx.input_tensor``
(``None`` on the first stage, which embeds the micro-batch instead); if the chunk has a
``set_input_tensor`` method it is also called with it first (Megatron's convention), so a model
whose ``forward(batch)`` cannot take the tensor as an argument still finds it. On the last stage
the function returns the micro-batch's loss, or ``(loss, logged)``; elsewhere the output
activation. Nothing here knows of Lightning.

Loss: each micro-batch's backward starts from ``loss / num_microbatches`` (mean over
micro-batches), or ``loss / num_tokens`` when the loss is a per-token sum and the token count of
the whole batch is given; the reported loss is reduced the same way. Both equal one run over the
whole batch (for the mean: when micro-batches weigh the same).

Memory: once sent, an output is only needed for its ``grad_fn``; its storage is swapped for a
one-element tensor expanded to its shape, so activation memory is bounded by the micro-batches
in flight, not their number, and ``torch.autograd.backward(output, grad)`` still sees the right
shape (Megatron bypasses that check with a private engine call instead).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Set,
                    Tuple, Union, cast)

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import ParallelState, get_parallel_state, has_parallel_state
from ..parallel.config import check_pipeline_schedule
from ..parallel.heartbeat import HEARTBEAT
from ..tensor_parallel.deferred_wgrad import WeightGradQueue, collect_weight_grads, enable_deferred_weight_grads
from .comm_plan import ChunkMicrobatch, comm_plan
from .p2p import PipelineP2P, prepare_group_for_batched_p2p
from .schedules import ScheduleStep
from ..parallel.stages import virtual_stage


@dataclass(frozen=True)
class StepContext:
    """What ``forward_step_fn`` learns about the call: which chunk, which micro-batch, its input."""

    microbatch_id: int
    chunk_id: int
    input_tensor: Optional[torch.Tensor]  # from the previous stage; None on the first stage
    is_first_stage: bool                  # first virtual stage: embeds the micro-batch
    is_last_stage: bool                   # last virtual stage: returns the loss


ForwardStepFn = Callable[[Any, nn.Module, StepContext], Any]


@dataclass
class PipelineOutput:
    """What the last stage computed; empty (``loss`` None) on other stages."""

    loss: Optional[torch.Tensor] = None  # reduced over micro-batches, detached
    losses: List[torch.Tensor] = field(default_factory=list)  # per micro-batch, detached
    logged: List[Any] = field(default_factory=list)           # per micro-batch, as returned


def deallocate_output_tensor(output: torch.Tensor) -> None:
    """Free an output's storage but keep its shape and ``grad_fn`` for the backward.

    The storage becomes one element expanded to the old shape. Views are left alone: they share
    storage with their base, which other tensors may still use.
    """
    if output._base is not None or output.numel() <= 1:
        return
    output.data = torch.empty(1, dtype=output.dtype, device=output.device).expand(output.shape)


def forward_backward(forward_step_fn: ForwardStepFn,
                     microbatches: Union[Sequence[Any], Iterator[Any], None],
                     model_chunks: Union[nn.Module, Sequence[nn.Module]], *,
                     num_microbatches: Optional[int] = None,
                     tensor_shape: Optional[Sequence[int]] = None,
                     dtype: torch.dtype = torch.float32,
                     variable_seq_lengths: bool = False,
                     forward_only: bool = False,
                     num_tokens: Optional[Union[int, float, torch.Tensor]] = None,
                     microbatch_group_size_per_vp_stage: Optional[int] = None,
                     no_sync: Optional[Callable[[], ContextManager[Any]]] = None,
                     finalize_grads: Optional[Callable[[], None]] = None,
                     pp_group: Optional[dist.ProcessGroup] = None,
                     device: Optional[torch.device] = None,
                     schedule: str = "1f1b") -> PipelineOutput:
    """Forward (and unless ``forward_only``, backward) of every micro-batch; see the module doc.

    - ``microbatches``: a sequence (indexed by micro-batch) or an iterator (read once, in
      order), or ``None`` on ranks that need no data; then ``num_microbatches`` is required.
    - ``model_chunks``: this rank's chunks; chunk ``k`` is virtual stage ``k * pp_size + pp_rank``.
    - ``tensor_shape``/``dtype``: of the activation sent between stages (and its gradient);
      with ``variable_seq_lengths`` shapes are sent ahead instead. Unused when ``pp_size == 1``.
    - ``num_tokens``: the whole batch's token count when the last stage returns per-token loss
      *sums*; otherwise the loss is a mean and micro-batches are averaged.
    - ``no_sync()``: a context that defers gradient reduction; it wraps every step except the
      last micro-batch (no pipelining) / the final backward (pipelined) / the last micro-batch's
      backward and weight steps (zero-bubble: weight steps of earlier micro-batches between them
      stay inside). ``finalize_grads()`` runs once after the last backward (e.g. DP reduce,
      ``allreduce_shared_embedding_grads``).
    - ``pp_group``: default the active ``ParallelState``'s; with no state, a single stage.
    - ``schedule``: ``"1f1b"`` (interleaved with several chunks) or ``"zb-h1"`` (one chunk); the
      latter marks the chunks' tensor-parallel linears to defer their weight gradients
      (``enable_deferred_weight_grads``; they behave as before outside a zero-bubble step).
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty; pass this rank's model chunk(s).")
    m = _num_microbatches(microbatches, num_microbatches)
    state, pp_group, pp_rank, pp_size = _pipeline(pp_group)
    if pp_size == 1 and len(chunks) > 1:
        raise ValueError(
            f"model_chunks has {len(chunks)} chunks but pp_size=1: interleaving needs "
            f"pp_size >= 2; pass a single chunk.")
    comm = None
    if pp_size > 1:
        device = device or _device_of(chunks)
        assert pp_group is not None   # more than one stage: a pipeline group exists
        comm = PipelineP2P(pp_group, tensor_shape, dtype, device, variable_seq_lengths)
        prepare_group_for_batched_p2p(pp_group, comm.device)
    zero_bubble = check_pipeline_schedule(schedule, len(chunks)) == "zb-h1" and not forward_only
    if zero_bubble:
        for chunk in chunks:
            enable_deferred_weight_grads(chunk)
    plan = comm_plan(m, pp_size, len(chunks), microbatch_group_size_per_vp_stage,
                     forward_only, schedule)[pp_rank]
    run = _Run(forward_step_fn, _Microbatches(microbatches, m, len(chunks)), chunks, pp_rank,
               pp_size, forward_only, m if num_tokens is None else num_tokens, zero_bubble)
    steps = [r.step for r in plan if r.step is not None]
    synced = _synced_steps(steps, pp_size, zero_bubble)
    running_chunk = _running_chunk(state, len(chunks))
    done, waiting = 0, False   # waiting: inside no_sync (left for the synced steps; zero-bubble comes back)
    beat, many_chunks = HEARTBEAT, len(chunks) > 1   # where this rank is, for the hang detector
    with ExitStack() as deferred:
        for rnd in plan:
            sent = None
            if rnd.step is not None:
                if no_sync is not None and not forward_only and waiting == (done in synced):
                    if waiting:
                        deferred.close()
                    else:
                        deferred.enter_context(no_sync())
                    waiting = not waiting
                chunk_id = rnd.step.chunk
                beat.at("weight gradients" if rnd.step.is_weight else rnd.step.phase, rnd.step.microbatch,
                        chunk_id if many_chunks else None, chunk_id * pp_size + pp_rank if pp_size > 1 else None)
                with running_chunk(chunk_id):
                    sent = run.step(rnd.step)
                done += 1
            if rnd.communicates:
                assert comm is not None, "comm_plan asked a single stage to communicate"
                beat.at(_exchange_name(rnd.send_next and sent is not None, rnd.send_prev and sent is not None,
                                       rnd.recv_prev is not None, rnd.recv_next is not None),
                        beat.microbatch, beat.chunk, beat.stage, waiting=True)
                from_prev, from_next = comm.communicate(
                    send_next=sent if rnd.send_next else None,
                    send_prev=sent if rnd.send_prev else None,
                    recv_prev=rnd.recv_prev is not None, recv_next=rnd.recv_next is not None)
                run.received(rnd.recv_prev, from_prev, rnd.recv_next, from_next)
            if rnd.send_next and not forward_only and sent is not None:
                deallocate_output_tensor(sent)
    for chunk in chunks:  # do not keep the last received activation alive until the next call
        set_input_tensor = getattr(chunk, "set_input_tensor", None)
        if callable(set_input_tensor):
            set_input_tensor(None)
    if finalize_grads is not None and not forward_only:
        finalize_grads()
    return run.output


def _synced_steps(steps: List[ScheduleStep], pp_size: int, zero_bubble: bool) -> Set[int]:
    """Indices of the steps that run outside ``no_sync``: those that give gradients their final value (and, with
    no pipelining, the last micro-batch's forward, as data-parallel wrappers expect)."""
    if zero_bubble:   # the last micro-batch's B (biases, norms, ...) and W (deferred weights)
        last = max(s.microbatch for s in steps)
        return {i for i, s in enumerate(steps) if not s.is_forward and s.microbatch == last}
    return set(range(len(steps) - (2 if pp_size == 1 else 1), len(steps)))


def _exchange_words(send_next: bool, send_prev: bool, recv_prev: bool, recv_next: bool) -> str:
    words = [w for w, on in (("send to next stage", send_next), ("send to previous stage", send_prev),
                             ("receive from previous stage", recv_prev), ("receive from next stage", recv_next)) if on]
    return " + ".join(words) or "exchange"


# every combination named once, so the schedule's loop only looks one up
_EXCHANGES = {(a, b, c, d): _exchange_words(a, b, c, d)
              for a in (False, True) for b in (False, True) for c in (False, True) for d in (False, True)}


def _exchange_name(send_next: bool, send_prev: bool, recv_prev: bool, recv_next: bool) -> str:
    """What one round's exchange does, e.g. "send to next stage + receive from previous stage"."""
    return _EXCHANGES[(bool(send_next), bool(send_prev), recv_prev, recv_next)]


class _Run:
    """State of one ``forward_backward`` call: tensors waiting for their step, and the results."""

    def __init__(self, forward_step_fn: ForwardStepFn, data: "_Microbatches",
                 chunks: List[nn.Module], pp_rank: int, pp_size: int, forward_only: bool,
                 denominator: Union[int, float, torch.Tensor], zero_bubble: bool = False) -> None:
        self.forward_step_fn, self.data, self.chunks = forward_step_fn, data, chunks
        self.pp_rank, self.pp_size, self.forward_only = pp_rank, pp_size, forward_only
        self.last_stage = pp_size * len(chunks) - 1
        self.denominator = denominator  # micro-batch count (mean) or token count (per-token sum)
        self.inputs: Dict[ChunkMicrobatch, torch.Tensor] = {}   # received, until forward/backward
        self.grads: Dict[ChunkMicrobatch, torch.Tensor] = {}    # received, until backward
        self.outputs: Dict[ChunkMicrobatch, torch.Tensor] = {}  # forward results, until backward
        # zero-bubble: per micro-batch, the weight gradients its backward left (from backward to weight step)
        self.weight_grads: Optional[Dict[ChunkMicrobatch, WeightGradQueue]] = {} if zero_bubble else None
        self.output = PipelineOutput()

    def step(self, step: ScheduleStep) -> Optional[torch.Tensor]:
        """Run one step; return what it sends (output activation / input gradient), if anything."""
        key = (step.chunk, step.microbatch)
        stage = virtual_stage(self.pp_size, self.pp_rank, step.chunk)
        if step.is_forward:
            with torch.no_grad() if self.forward_only else nullcontext():
                return self._forward(key, stage)
        if step.is_weight:
            assert self.weight_grads is not None, "a weight step outside the zero-bubble schedule"
            self.weight_grads.pop(key).run()
            return None
        if self.weight_grads is not None:
            with collect_weight_grads(self.weight_grads.setdefault(key, WeightGradQueue())):
                return self._backward(key, stage)
        return self._backward(key, stage)

    def _forward(self, key: ChunkMicrobatch, stage: int) -> Optional[torch.Tensor]:
        chunk_id, mb = key
        inp = None
        if stage > 0:  # kept for the backward, which sends its gradient back
            inp = self.inputs.pop(key) if self.forward_only else self.inputs[key]
        chunk = self.chunks[chunk_id]
        set_input_tensor = getattr(chunk, "set_input_tensor", None)
        if callable(set_input_tensor):
            set_input_tensor(inp)
        ctx = StepContext(mb, chunk_id, inp, stage == 0, stage == self.last_stage)
        result = self.forward_step_fn(self.data.get(mb, chunk_id), chunk, ctx)
        if stage < self.last_stage:
            if not isinstance(result, torch.Tensor):
                raise TypeError(
                    f"forward_step_fn must return the output activation (a tensor) on non-last "
                    f"stages, got {type(result).__name__} (chunk {chunk_id}, micro-batch {mb}).")
            if not self.forward_only:
                self.outputs[key] = result
            return result
        loss, logged = _loss_and_logged(result)
        if not self.forward_only:
            if loss.dim() != 0:
                raise ValueError(
                    f"forward_step_fn returned a loss of shape {tuple(loss.shape)} on the last "
                    f"stage; training needs a scalar (reduce it, e.g. .mean() or a per-token "
                    f".sum() with num_tokens=...).")
            self.outputs[key] = loss / self.denominator
        self._record(mb, loss.detach(), logged)
        return None

    def _backward(self, key: ChunkMicrobatch, stage: int) -> Optional[torch.Tensor]:
        out = self.outputs.pop(key)
        inp = self.inputs.pop(key, None)
        grad = self.grads.pop(key) if stage < self.last_stage else None
        torch.autograd.backward(out, grad_tensors=grad)
        if stage == 0:
            return None
        if inp is None or inp.grad is None:
            raise RuntimeError(
                f"chunk {key[0]} (virtual stage {stage}) produced no gradient for its input "
                f"tensor on micro-batch {key[1]}: forward_step_fn must compute the output from "
                f"ctx.input_tensor (or the tensor given to set_input_tensor) on non-first stages.")
        return inp.grad

    def received(self, prev_key: Optional[ChunkMicrobatch], from_prev: Optional[torch.Tensor],
                 next_key: Optional[ChunkMicrobatch], from_next: Optional[torch.Tensor]) -> None:
        if prev_key is not None:
            assert from_prev is not None, "a receive from the previous stage returned nothing"
            self.inputs[prev_key] = from_prev.requires_grad_(not self.forward_only)
        if next_key is not None:
            assert from_next is not None, "a receive from the next stage returned nothing"
            self.grads[next_key] = from_next

    def _record(self, mb: int, loss: torch.Tensor, logged: Any) -> None:
        out = self.output
        out.losses.append(loss)
        out.logged.append(logged)
        if len(out.losses) == self.data.num_microbatches and all(l.dim() == 0 for l in out.losses):
            out.loss = torch.stack(out.losses).sum() / self.denominator


def _running_chunk(state: Optional[ParallelState], num_chunks: int) -> Callable[[int], ContextManager[None]]:
    """What each step runs under so models see its chunk (``ParallelState.running_chunk``) when the
    state has one virtual rank per chunk."""
    if state is None or state.virtual_pipeline_size != num_chunks:
        return lambda chunk: nullcontext()
    return state.running_chunk


class _Microbatches:
    """Micro-batch ``i`` for chunk ``k``: indexed from a sequence, or read once from an iterator
    and kept until the last chunk has used it (forwards meet micro-batches in order)."""

    def __init__(self, source: Union[Sequence[Any], Iterator[Any], None], num_microbatches: int,
                 num_chunks: int) -> None:
        self.source, self.num_microbatches, self.num_chunks = source, num_microbatches, num_chunks
        self.is_sequence = source is not None and hasattr(source, "__getitem__")
        self.cache: Dict[int, Tuple[Any, int]] = {}  # micro-batch -> (data, uses left)
        self.next_to_read = 0

    def get(self, mb: int, chunk: int) -> Any:
        if self.source is None:
            return None
        if self.is_sequence:
            return cast(Sequence[Any], self.source)[mb]
        if mb not in self.cache:
            if mb != self.next_to_read:
                raise RuntimeError(f"micro-batch {mb} requested before {self.next_to_read}: "
                                   f"the iterator can only be read in order.")
            try:
                self.cache[mb] = (next(cast(Iterator[Any], self.source)), self.num_chunks)
            except StopIteration:
                raise ValueError(
                    f"microbatches ran out after {mb} items but num_microbatches="
                    f"{self.num_microbatches}; pass as many micro-batches as num_microbatches.")
            self.next_to_read += 1
        data, uses = self.cache[mb]
        if uses == 1:
            del self.cache[mb]
        else:
            self.cache[mb] = (data, uses - 1)
        return data


def _num_microbatches(microbatches: Any, num_microbatches: Optional[int]) -> int:
    if microbatches is not None and hasattr(microbatches, "__len__") \
            and hasattr(microbatches, "__getitem__"):
        n = len(microbatches)
        if num_microbatches is not None and num_microbatches != n:
            raise ValueError(f"num_microbatches={num_microbatches} but {n} micro-batches were "
                             f"given; drop num_microbatches or pass {num_microbatches} of them.")
        num_microbatches = n
    if num_microbatches is None:
        raise ValueError("num_microbatches is required when microbatches is an iterator or None "
                         "(ranks without data); pass num_microbatches=<count>.")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
            or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}.")
    return num_microbatches


def _pipeline(pp_group: Optional[dist.ProcessGroup]
              ) -> Tuple[Optional[ParallelState], Optional[dist.ProcessGroup], int, int]:
    """(state owning the group, or None; pp group; pp rank; pp size). No group and no active
    state: a single stage, without torch.distributed."""
    state = get_parallel_state() if has_parallel_state() else None
    if pp_group is None and state is not None:
        pp_group = state.pp_group
    if pp_group is None:
        return None, None, 0, 1
    owner = state if state is not None and pp_group is state.pp_group else None
    return owner, pp_group, dist.get_rank(pp_group), dist.get_world_size(pp_group)


def _device_of(chunks: List[nn.Module]) -> torch.device:
    for chunk in chunks:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


def _loss_and_logged(result: Any) -> Tuple[torch.Tensor, Any]:
    if isinstance(result, torch.Tensor):
        return result, None
    if isinstance(result, (tuple, list)) and len(result) == 2 \
            and isinstance(result[0], torch.Tensor):
        return result[0], result[1]
    raise TypeError(
        f"forward_step_fn must return the loss tensor or a (loss, logged) pair on the last "
        f"stage, got {type(result).__name__}.")
