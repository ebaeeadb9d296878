"""Python faces of the project's kernels (Triton here; CUDA C++ in ``csrc/``), each beside the pure-PyTorch
path it replaces, and the per-family on/off switch (``switch.KernelSwitch``).

- ``moe_permute``: token permute/unpermute for MoE dispatch (used by ``moe.permute``).
- ``swiglu``: the gated MLP activations SwiGLU and GeGLU, forward and backward one kernel each, as custom
  operators ``torch.compile`` traces (used by ``transformer.mlp``; ``LM_SWIGLU_KERNELS=0``: the torch expression).

The fused linear + cross-entropy kernels live with their autograd function in
``tensor_parallel/fused_cross_entropy.py``.
"""

from .switch import KernelSwitch

__all__ = ["KernelSwitch"]
