"""The process groups one MoE layer talks over (MoE folding, seed 001).

The attention side of a layer lives on the dense grid (tp, cp, dp, pp); the experts on the
expert grid (etp, ep, edp, pp) of the same ranks. The MoE layer touches both:

- ``tp``: the dense tensor-parallel group its input and output are laid out over (replicated or
  sequence-parallel), and that shared experts are split over;
- ``tp_cp``: ranks holding slices of the same sequences, over which the balancing losses' token
  counts are summed;
- ``ep`` / ``etp``: experts are split over ep; each expert's weights are split over etp;
- ``tp_ep``: the expert model-parallel group (etp × ep ranks holding one copy of every expert),
  over which the all-gather dispatcher gathers tokens.

``None`` stands for a group of one rank, so a layer also runs on a single process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class MoEGroups:
    tp: Optional[dist.ProcessGroup] = None
    tp_cp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    etp: Optional[dist.ProcessGroup] = None
    tp_ep: Optional[dist.ProcessGroup] = None

    @classmethod
    def from_state(cls, state=None) -> "MoEGroups":
        """The groups of ``state`` (default: the active ``ParallelState``)."""
        from ..parallel import get_parallel_state

        state = state or get_parallel_state()
        return cls(tp=state.group("tp"), tp_cp=state.group("tp-cp"), ep=state.group("ep"),
                   etp=state.group("etp"), tp_ep=state.group("tp-ep"))

    @classmethod
    def resolve(cls, explicit: Optional["MoEGroups"]) -> "MoEGroups":
        """``explicit``, else the active state's groups, else single-process groups."""
        if explicit is not None:
            return explicit
        from ..parallel import has_parallel_state

        return cls.from_state() if has_parallel_state() else cls()
