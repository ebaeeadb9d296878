"""Tied word embeddings across the pipeline: the first stage's input embedding and the last
stage's output layer are one logical parameter held twice.

Mark both copies with ``param.shared_embedding = True``. They must start equal
(:func:`sync_shared_embedding_weights`, a broadcast from the first stage) and receive the sum of
both stages' gradients (:func:`allreduce_shared_embedding_grads`, over the ``embedding`` group:
first and last stage of each pipeline), so they stay equal after every optimizer step. With one
stage the two uses share one ``Parameter`` and both functions do nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

Modules = Union[nn.Module, Iterable[nn.Module]]


def shared_embedding_parameters(model_chunks: Modules) -> List[nn.Parameter]:
    """Parameters marked ``shared_embedding=True`` in ``model_chunks``, in order, each once."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    seen, found = set(), []
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "shared_embedding", False) and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


def allreduce_shared_embedding_grads(model_chunks: Modules,
                                     group: Optional[dist.ProcessGroup] = None) -> None:
    """Sum the shared-embedding gradients of the first and last stage (``main_grad`` if present).

    Collective over the embedding group: call it on every rank (ranks outside the group, i.e.
    middle stages, return at once). ``group`` defaults to the active ``ParallelState``'s.
    """
    group = _embedding_group(group)
    if group is None:
        return
    params = shared_embedding_parameters(model_chunks)
    _check_same_layout(params, group, "allreduce_shared_embedding_grads")
    if not params:
        return
    grads = []
    for param in params:
        if getattr(param, "main_grad", None) is not None:
            grads.append(param.main_grad)  # type: ignore[attr-defined]  # runtime attribute
        else:
            if param.grad is None:  # unused on this stage this step: contribute zeros
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def sync_shared_embedding_weights(model_chunks: Modules, group: Optional[dist.ProcessGroup] = None,
                                  src: Optional[int] = None) -> None:
    """Copy the first stage's shared-embedding weights to the last stage's copies.

    Collective over the embedding group, like :func:`allreduce_shared_embedding_grads`. ``src``
    is the first stage's global rank: by default the active state's first pipeline rank, or the
    group's lowest rank when ``group`` is given.
    """
    if group is None and src is None:
        from ..parallel import get_parallel_state

        state = get_parallel_state()
        src = state.ranks("pp")[0]
    group = _embedding_group(group)
    if group is None:
        return
    if src is None:
        src = dist.get_global_rank(group, 0)
    params = shared_embedding_parameters(model_chunks)
    _check_same_layout(params, group, "sync_shared_embedding_weights")
    if not params:
        return
    with torch.no_grad():
        flat = _flatten_dense_tensors([p.data for p in params])
        dist.broadcast(flat, src=src, group=group)
        for param, synced in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
            param.copy_(synced)


def _embedding_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group to reduce over, or None when there is nothing to do on this rank."""
    if group is None:
        from ..parallel import get_parallel_state  # the one accessor to process groups

        state = get_parallel_state()
        if not state.in_embedding_group:
            return None
        group = state.group("embedding")
    return group if dist.get_world_size(group) > 1 else None


def _check_same_layout(params: List[nn.Parameter], group: dist.ProcessGroup, caller: str) -> None:
    """Both stages must hold the same shared parameters; a mismatch would hang or mix tensors."""
    device = params[0].device if params else _group_device(group)
    mine = torch.tensor([len(params), sum(p.numel() for p in params)], dtype=torch.int64,
                        device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    layouts = [tuple(t.tolist()) for t in everyone]
    if len(set(layouts)) > 1:
        raise ValueError(
            f"{caller}: the stages of the embedding group hold different shared-embedding "
            f"parameters ((count, elements) per stage: {layouts}); mark the first stage's word "
            f"embedding and the last stage's output weight, and only them, with "
            f"shared_embedding=True (same shapes), or untie them by marking neither.")


def _group_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- the optimizer must treat both copies alike ---------------------------------------------------------

Settings = Tuple[str, Tuple[Tuple[str, Any], ...]]


def check_tied_optimizer_settings(named_parameters: Iterable[Tuple[str, nn.Parameter]],
                                  optimizers: Sequence[torch.optim.Optimizer], pp_size: int) -> None:
    """Raise, on every rank, when the two copies of a tied embedding get different optimizer settings.

    Under pipeline parallelism the tied weight is two parameters (first stage's word embeddings, last
    stage's output weight) kept equal by equal gradients, so only equal updates keep them one weight:
    a parameter-group rule by name or module that picks the word embeddings misses the output weight and
    silently unties them. Collective over the world (once, at setup); nothing to check with one stage.
    """
    if pp_size == 1:
        return
    mine, seen = [], set()
    for name, param in named_parameters:
        if getattr(param, "shared_embedding", False) and id(param) not in seen:
            seen.add(id(param))
            mine.append((name, optimizer_settings(param, optimizers)))
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    message = tied_settings_mismatch([entry for part in everyone for entry in part])
    if message is not None:
        raise ValueError(message)


def optimizer_settings(param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer]) -> Settings:
    """Which optimizer updates ``param`` and its parameter group's options (comparable across ranks)."""
    if not param.requires_grad:
        return "frozen (requires_grad=False)", ()
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                options = tuple(sorted((k, _comparable(v)) for k, v in group.items() if k != "params"))
                return f"optimizer {index} ({type(optimizer).__name__})", options
    return "in no optimizer", ()


def tied_settings_mismatch(entries: Sequence[Tuple[str, Settings]]) -> Optional[str]:
    """The error for copies ``(name, settings)`` of the tied weight whose settings differ, else ``None``."""
    distinct: dict = {}
    for name, settings in entries:
        distinct.setdefault(settings, []).append(name)
    if len(distinct) <= 1:
        return None
    options = [dict(settings[1]) for settings in distinct]
    differing = sorted({k for o in options for k in o if any(p.get(k, "<unset>") != o.get(k, "<unset>")
                                                               for p in options)})
    described = []
    for (where, opts), names in distinct.items():
        shown = ", ".join(f"{k}={dict(opts).get(k, '<unset>')}" for k in differing)
        described.append(f"{' / '.join(sorted(set(names)))}: {where}" + (f", {shown}" if shown else ""))
    return ("the tied word embedding is two parameters under pipeline parallelism (the first stage's word "
            "embeddings and the last stage's output weight), and configure_optimizers gives them different "
            f"settings ({'; '.join(described)}). They must get the same updates to stay one weight: put both in "
            "parameter groups with the same settings (a rule by name must match both names; "
            "getattr(param, 'shared_embedding', False) is True on both copies), or untie them (GPTModel's "
            "tie_word_embeddings=False).")


def _comparable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__   # an object's repr may hold its address, which differs between ranks
