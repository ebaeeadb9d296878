"""The feed-forward block: column-parallel fc1, activation, row-parallel fc2 (seed 002, Figure 3a).

The activation is applied to each rank's slice independently, which is why fc1 is split by
columns: no communication between the two GEMMs. For SwiGLU and GeGLU, fc1 holds gate and up
projections; ``stride=2`` makes each shard hold its slice of both. Their activation is ``ops/swiglu.py``'s:
a fused Triton kernel forward and backward on CUDA (``LM_SWIGLU_KERNELS=0``: the torch expression).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import swiglu as gated
from ..parallel import get_parallel_state
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_method_normal
from .config import FFN_SPLIT, GATED_ACTIVATIONS, TransformerConfig, check_splits_over_tensor_parallel


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None   # TransformerConfig.__post_init__ filled it
        check_splits_over_tensor_parallel("ffn_hidden_size", config.ffn_hidden_size, get_parallel_state().tp_size,
                                          FFN_SPLIT)
        self.activation = config.activation
        gated = config.activation in GATED_ACTIVATIONS
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, (2 if gated else 1) * config.ffn_hidden_size, bias=config.add_bias_linear,
            init_method=init_method_normal(config.init_method_std), sequence_parallel=config.sequence_parallel,
            stride=2 if gated else 1, params_dtype=config.params_dtype, comm_overlap=config.tp_comm_overlap,
            grad_accumulation_fusion=config.gradient_accumulation_fusion)
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear, input_is_parallel=True,
            init_method=init_method_normal(config.output_layer_init_std),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
            comm_overlap=config.tp_comm_overlap,
            grad_accumulation_fusion=config.gradient_accumulation_fusion)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.fc1(hidden)
        if self.activation == "swiglu":
            h = gated.swiglu(h)     # silu(gate) * up; one Triton kernel each way on CUDA (ops/swiglu.py)
        elif self.activation == "geglu":
            h = gated.geglu(h)      # gelu_tanh(gate) * up, likewise
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.fc2(h)
