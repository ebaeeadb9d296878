"""The line that tells the user, at setup, which layers every pipeline stage holds."""

from __future__ import annotations

from typing import List, Optional, Sequence

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..parallel import ParallelState


def describe_layout(layout: Sequence[int], pp_size: int) -> str:
    """``(5, 5, 5, 1)`` on 4 stages -> ``"stage 0: layers 0-4 | ... | stage 3: layer 15"``; a stage's virtual
    chunks are listed in its order, an empty chunk as ``-``."""
    starts = [sum(layout[:v]) for v in range(len(layout))]
    stages: List[List[str]] = [[] for _ in range(pp_size)]
    for v, (start, count) in enumerate(zip(starts, layout)):
        stages[v % pp_size].append("-" if not count else str(start) if count == 1 else f"{start}-{start + count - 1}")
    parts = []
    for rank, chunks in enumerate(stages):
        total = sum(layout[rank::pp_size])
        parts.append(f"stage {rank}: {total} layer{'s' if total != 1 else ''} ({', '.join(chunks)})")
    return " | ".join(parts)


def report_pipeline_layout(module: nn.Module, state: ParallelState) -> Optional[str]:
    """Log (global rank 0) the layouts of the model's pipelined stacks (``pipeline_layout`` of ``GPTModel``,
    ``BertModel``); returns the message, or None without pipeline parallelism or such a stack."""
    if state.pp_size == 1:
        return None
    layouts = []
    for sub in module.modules():
        layout = getattr(sub, "pipeline_layout", None)
        if isinstance(layout, tuple) and layout not in layouts:
            layouts.append(layout)
    if not layouts:
        return None
    message = "\n".join(f"pipeline layout {list(layout)}: {describe_layout(layout, state.pp_size)}"
                        for layout in layouts)
    rank_zero_info(message)
    return message
