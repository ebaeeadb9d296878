"""Mixture-of-experts building blocks. So far: the ECHO expert-offloading planner."""

from .echo import (
    apply_offloading_plan,
    breadth_first_allocation,
    depth_first_allocation,
    gen_assignment,
    gen_intermediate,
    gen_offloading_plan,
    home_expert_of_column,
    home_expert_of_spare,
    interleave_spare_slots,
    one_shot_greedy_assignment,
)

__all__ = [
    "apply_offloading_plan",
    "breadth_first_allocation",
    "depth_first_allocation",
    "gen_assignment",
    "gen_intermediate",
    "gen_offloading_plan",
    "home_expert_of_column",
    "home_expert_of_spare",
    "interleave_spare_slots",
    "one_shot_greedy_assignment",
]
