"""The few collectives the checkpoint code needs, and their single-process stand-ins."""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def agree(error: Optional[BaseException], payload: Any = None) -> List[Any]:
    """Gather ``payload`` from every rank; if any rank failed, raise the lowest failing rank's
    error on every rank, so none of them goes on into a collective the others never enter."""
    local = (None if error is None else (type(error), str(error)), payload)
    if world_size() > 1:   # one process alone: no collective (over NCCL it would wait for the GPU's queue)
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    for failure, _ in gathered:
        if failure is None:
            continue
        kind, message = failure
        if error is not None and type(error) is kind and str(error) == message:
            raise error
        try:
            raised = kind(message)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            raised = RuntimeError(message)
        raise raised
    return [payload for _, payload in gathered]
