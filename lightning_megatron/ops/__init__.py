"""Python faces of the project's kernels (Triton here; CUDA C++ in ``csrc/``), each beside the pure-PyTorch
path it replaces, and the per-family on/off switch (``switch.KernelSwitch``).

- ``moe_permute``: token permute/unpermute for MoE dispatch (used by ``moe.permute``).

The fused linear + cross-entropy kernels live with their autograd function in
``tensor_parallel/fused_cross_entropy.py``.
"""

from .switch import KernelSwitch

__all__ = ["KernelSwitch"]
