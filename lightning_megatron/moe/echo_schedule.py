"""When an MoE layer's ECHO plans: in the steps after one whose routing needed offloading.

ECHO's plan costs a count all-gather and ~80 small kernels per layer and micro-batch whatever the routing, and the
expert-parallel step is host-bound (benchmarks/RESULTS.md: 0.72x at EP4 under balanced routing). A layer whose
routing stayed within ``echo_tolerance`` in every micro-batch of a training step routes the next step as if it had
no spare slots (no plan, the dispatcher of its home experts), while still watching each EP rank's load, which the
dispatch reads in the host sync it makes anyway; a step in which some micro-batch would have spilled (or did use a
slot) plans again in the step after. So balanced routing pays one step of planning, skewed routing is offloaded
from its second step on.

The decision changes only between optimizer steps (``next_step``, called by the training step after the
optimizer), so a recomputed forward takes the path of its forward; it is the same on every rank of the expert
group (it reads the all-gathered counts, or the plan every rank computed alike). Outputs and gradients never
depend on it: the layer equals the layer without ECHO either way. Without observations (the all-gather dispatcher,
a model trained outside the strategy) the layer plans every forward, as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .echo import any_rank_spills


@dataclass
class EchoSchedule:
    """Whether this step's forwards plan (``plans``), and what this step has seen so far."""

    plans: bool = True
    needed: Optional[bool] = None   # whether some forward of this step needed offloading; None: none observed

    def saw_plan(self, slots_used: Optional[bool]) -> None:
        """A planned forward's dispatch: whether it put tokens on a spare slot (None: not read)."""
        if slots_used is not None:
            self.needed = bool(self.needed) or slots_used

    def saw_loads(self, rows_per_ep_rank: Optional[Sequence[int]], tolerance: float) -> None:
        """An unplanned forward's dispatch: the rows each EP rank received (None: not read), against the planner's
        ``tolerance``."""
        if rows_per_ep_rank is not None:
            self.needed = bool(self.needed) or any_rank_spills(rows_per_ep_rank, tolerance)

    def next_step(self) -> None:
        """After an optimizer step: plan in the next one if this one needed it, or if nothing was observed."""
        self.plans = True if self.needed is None else self.needed
        self.needed = None
