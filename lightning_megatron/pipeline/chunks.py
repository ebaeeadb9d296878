"""A rank's virtual-pipeline chunks of one model, run one at a time as the schedule asks."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..parallel import get_parallel_state


class VirtualChunks(nn.Module):
    """Builds ``build(vp_rank)`` for every local virtual chunk; calls go to the current one.

    With interleaved pipelining each rank holds several non-adjacent pieces of the model
    (seed 000: stage 0 holds layers [0, 1] and [4, 5] of 8). The schedule sets the active
    chunk it runs (``ParallelState.running_chunk``); ``forward`` and ``set_input_tensor`` follow it.
    Without virtual stages this holds one chunk and behaves like it.

    ``chunk_level_in_names = False`` tells checkpoint naming (``models.sharding``) that the ``chunks.<v>.``
    level is not part of the single-process model's parameter names.
    """

    chunk_level_in_names = False

    def __init__(self, build: Callable[[int], nn.Module]) -> None:
        super().__init__()
        size = get_parallel_state().virtual_pipeline_size or 1
        self.chunks = nn.ModuleList(build(vp_rank) for vp_rank in range(size))

    @property
    def current(self) -> nn.Module:
        return self.chunks[get_parallel_state().virtual_pipeline_rank or 0]

    @property
    def pre_process(self) -> bool:
        return bool(self.current.pre_process)

    @property
    def post_process(self) -> bool:
        return bool(self.current.post_process)

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.current.set_input_tensor(tensor)  # type: ignore[operator]  # Module.__getattr__ hides the method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.current(*args, **kwargs)
