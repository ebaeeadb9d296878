"""Mixture-of-experts building blocks: router, token dispatchers, grouped experts, the MoE layer,
and the ECHO expert-offloading planner."""

from .aux_loss import AttachAuxLoss, sequence_load_balancing_loss, switch_load_balancing_loss, z_loss
from .dispatcher import (
    AllGatherTokenDispatcher, AllToAllTokenDispatcher, DispatchMetadata, TokenDispatcher, build_dispatcher,
)
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
    plan_token_moves,
    reroute_probs,
)
from .experts import GroupedMLP, SharedExpertMLP, grouped_mm_available
from .groups import MoEGroups
from .layer import MoEConfig, MoELayer
from .permute import permute, permute_indexed, permute_per_token, permute_probs, unpermute, unpermute_per_token
from .router import TopKRouter, collect_aux_losses, set_aux_loss_scale, update_expert_biases
from .routing import apply_capacity, expert_capacity, group_limited_topk, topk_routing
from .spare_weights import weights_with_spare_slots

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
    "plan_token_moves",
    "reroute_probs",
    "weights_with_spare_slots",
    # MoE layer
    "MoEConfig", "MoELayer", "MoEGroups",
    "TopKRouter", "update_expert_biases", "topk_routing", "group_limited_topk", "expert_capacity", "apply_capacity",
    "AttachAuxLoss", "switch_load_balancing_loss", "sequence_load_balancing_loss", "z_loss",
    "set_aux_loss_scale", "collect_aux_losses",
    "TokenDispatcher", "AllToAllTokenDispatcher", "AllGatherTokenDispatcher", "DispatchMetadata",
    "build_dispatcher", "permute", "permute_indexed", "permute_probs", "unpermute", "permute_per_token", "unpermute_per_token",
    "GroupedMLP", "SharedExpertMLP", "grouped_mm_available",
]
