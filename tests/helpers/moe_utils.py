"""Shared by the MoE layer tests: a layer's weights (or reduced gradients) as one process holds them."""

import torch.distributed as dist

from lightning_megatron.tensor_parallel.mappings import gather_along_dim


def _unstride(w, parts, dim):
    """Undo the per-rank [gate_r; up_r] interleave of a gathered SwiGLU weight along ``dim``."""
    shape = w.shape
    w = w.reshape(shape[:dim] + (parts, 2, shape[dim] // (2 * parts)) + shape[dim + 1:])
    return w.transpose(dim, dim + 1).reshape(shape)


def global_weights(layer, state, grads):
    """Router, expert and shared-expert weights (or their reduced gradients) as on one process."""
    pick = (lambda p: p.grad) if grads else (lambda p: p.detach())
    glu = layer.config.activation == "swiglu"
    router = pick(layer.router.weight).clone()
    w1, w2 = pick(layer.experts.weight1).clone(), pick(layer.experts.weight2).clone()
    if grads:
        dist.all_reduce(router)                       # tp partial sums (split tokens) + dp replicas
        dist.all_reduce(w1, group=state.group("edp"))
        dist.all_reduce(w2, group=state.group("edp"))
    w1 = gather_along_dim(w1, 1, state.group("etp"))
    if glu:
        w1 = _unstride(w1, state.etp_size, 1)
    out = {"router": router,
           "w1": gather_along_dim(w1, 0, state.group("ep")),
           "w2": gather_along_dim(gather_along_dim(w2, 2, state.group("etp")), 0, state.group("ep"))}
    if layer.shared_experts is not None:
        s1, s2 = pick(layer.shared_experts.fc1.weight).clone(), pick(layer.shared_experts.fc2.weight).clone()
        if grads:
            dist.all_reduce(s1, group=state.group("dp"))
            dist.all_reduce(s2, group=state.group("dp"))
        s1 = gather_along_dim(s1, 0, state.group("tp"))
        out["s1"] = _unstride(s1, state.tp_size, 0) if glu else s1
        out["s2"] = gather_along_dim(s2, 1, state.group("tp"))
    return out
