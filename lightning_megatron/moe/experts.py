"""Expert MLPs: all local experts in one grouped GEMM per projection, and the shared experts.

``GroupedMLP`` holds every local expert's weights in two 3-D tensors and takes the experts'
rows concatenated expert by expert with their counts as a *device* tensor (seed 004): the
counts never have to reach the host. Three kernels, picked per call:

- ``"bmm"``: every expert has the same static row count (pad-to-capacity): one batched matmul.
- ``"grouped_mm"``: ``torch._grouped_mm`` with the counts' cumulative sum as device offsets
  (CUDA, bfloat16, a GPU that supports it -- Hopper -- probed once at runtime).
- ``"loop"``: one matmul per expert. Splitting needs the counts on the host: free for CPU
  tensors, one device→host copy on a GPU (the fallback the benchmark compares against).

``float8`` (set by ``lightning_megatron.quantization.float8.enable_fp8``) replaces all three: a grouped GEMM whose
groups must be aligned (float8: multiples of 16), run on the rows laid out by
``aligned_groups.align_groups`` -- still no host synchronization.

Weights are initialized shard-consistently: global expert ``e`` is drawn from a generator
seeded with ``base + e`` (``base`` drawn once from the default generator, identical on every
rank) as a full float32 master, and each rank keeps its etp slice. EP=N therefore holds exactly
the numbers EP=1 holds, whatever the layout.
"""

from __future__ import annotations

import functools
from typing import Optional, Protocol, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import swiglu as gated
from ..tensor_parallel.layers import (
    ColumnParallelLinear, InitMethod, RowParallelLinear, init_method_normal, init_sharded_,
)
from ..tensor_parallel.utils import divide, set_tensor_model_parallel_attributes
from .aligned_groups import align_groups

ACTIVATIONS = ("swiglu", "gelu")
BACKENDS = ("auto", "grouped_mm", "loop", "bmm")


def _activate(h: Tensor, activation: str) -> Tensor:
    if activation == "swiglu":   # silu(gate) * up: the dense MLP's Triton kernel on CUDA (ops/swiglu.py)
        return gated.swiglu(h)
    return F.gelu(h)


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_index: int) -> bool:
    """Try one tiny ``torch._grouped_mm`` on the device; unsupported GPUs raise on the host."""
    try:
        device = torch.device("cuda", device_index)
        a = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
        b = torch.zeros(2, 16, 16, dtype=torch.bfloat16, device=device)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        return True
    except Exception:  # noqa: BLE001 - any failure means "use the fallback"
        return False


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` with device offsets runs here (CUDA + bfloat16 + sm90-class GPU)."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    return _grouped_mm_works(index)


def _expert_master(shape, init_method: InitMethod, seed: int):
    """Context-free draw of one expert's float32 master weight from its own CPU generator."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        master = torch.empty(shape, dtype=torch.float32, device="cpu")   # not the default device (Lightning: cuda)
        init_method(master)
    return master


class AlignedGroupedMatmul(Protocol):
    """``(a [R, K], b_t [E, K, N], offsets) -> [R, N]`` per group, groups aligned to ``alignment`` rows
    (``quantization.float8.Float8GroupedMatmul``)."""

    alignment: int

    def __call__(self, a: Tensor, b_t: Tensor, offsets: Tensor) -> Tensor: ...


def _copy_of(weight: Tensor) -> InitMethod:
    """An init method that copies ``weight`` (a slice of the expert's master) into the shard."""
    return lambda t: t.copy_(weight)


class GroupedMLP(nn.Module):
    """``num_local_experts`` MLPs ``act(x W1ᵀ) W2ᵀ`` over rows grouped by expert.

    ``weight1 [E_local, n·F/etp, H]`` (n = 2 for SwiGLU: this rank's gate and up slices) and
    ``weight2 [E_local, H, F/etp]``. With etp > 1 the output is this rank's *partial sum*; the
    dispatcher's reduce over etp completes it. No biases (as in Megatron's grouped experts).
    Parameters carry ``expert_parallel=True``: their gradients are reduced over the expert
    data-parallel group (edp), not dp.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 activation: str = "swiglu", first_expert: int = 0, etp_size: int = 1, etp_rank: int = 0,
                 init_method: Optional[InitMethod] = None, output_layer_init_method: Optional[InitMethod] = None,
                 params_dtype: torch.dtype = torch.float32, device: Optional[Union[torch.device, str]] = None,
                 backend: str = "auto", perform_initialization: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        self.num_local_experts, self.hidden_size, self.ffn_hidden_size = num_local_experts, hidden_size, ffn_hidden_size
        self.activation, self.backend = activation, backend
        self.first_expert, self.etp_size, self.etp_rank = first_expert, etp_size, etp_rank
        # (a [R, K], b_t [E, K, N], offsets) -> [R, N] per group, groups aligned to its ``alignment``
        self.float8: Optional[AlignedGroupedMatmul] = None
        n = 2 if activation == "swiglu" else 1
        ffn_local = divide(ffn_hidden_size, etp_size, "ffn_hidden_size", by="expert tensor-parallel size (etp)")
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, n * ffn_local, hidden_size,
                                                dtype=params_dtype, device=device))
        self.weight2 = nn.Parameter(torch.empty(num_local_experts, hidden_size, ffn_local,
                                                dtype=params_dtype, device=device))
        for weight, dim in ((self.weight1, 1), (self.weight2, 2)):
            set_tensor_model_parallel_attributes(weight, etp_size > 1, dim, n if dim == 1 else 1)
            weight.expert_parallel = True  # type: ignore[attr-defined]  # runtime attribute
        if perform_initialization:
            self.reset_parameters(init_method or init_method_normal(),
                                  output_layer_init_method or init_method or init_method_normal())

    @torch.no_grad()
    def reset_parameters(self, init_method: InitMethod, output_layer_init_method: InitMethod) -> None:
        n = 2 if self.activation == "swiglu" else 1
        # one draw of the (rank-identical) CPU generator; explicit device: under Lightning's default-device
        # context a plain draw would come from the CUDA generator, consumed differently per EP rank
        base = int(torch.randint(0, 2 ** 40, (1,), device="cpu"))
        for i in range(self.num_local_experts):
            seed = base + 2 * (self.first_expert + i)
            w1 = _expert_master((n * self.ffn_hidden_size, self.hidden_size), init_method, seed)
            w2 = _expert_master((self.hidden_size, self.ffn_hidden_size), output_layer_init_method, seed + 1)
            init_sharded_(self.weight1[i], w1.shape, 0, _copy_of(w1), self.etp_rank, self.etp_size, stride=n)
            init_sharded_(self.weight2[i], w2.shape, 1, _copy_of(w2), self.etp_rank, self.etp_size)

    def pick_backend(self, x: Tensor, rows_per_expert: Optional[int]) -> str:
        if self.backend != "auto":
            return self.backend
        if rows_per_expert is not None:
            return "bmm"
        aligned = self.hidden_size % 8 == 0 and self.weight2.shape[-1] % 8 == 0
        if aligned and grouped_mm_available(x.device, x.dtype) and x.dtype == self.weight1.dtype:
            return "grouped_mm"
        return "loop"

    def forward(self, x: Tensor, tokens_per_expert: Tensor, rows_per_expert: Optional[int] = None,
                weights: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        """``x [R, H]``: rows of expert 0, then expert 1, ...; ``tokens_per_expert`` (one count per
        expert) on any device; ``rows_per_expert``: the static count when every expert has the same
        (padded). ``weights``: ``(weight1, weight2)``-shaped stand-ins with more experts (ECHO's
        home experts followed by the spare slots' copies); default this module's own."""
        backend = self.pick_backend(x, rows_per_expert)
        w1, w2 = weights if weights is not None else (self.weight1, self.weight2)
        if w1.shape[1:] != self.weight1.shape[1:] or w2.shape[1:] != self.weight2.shape[1:]:
            raise ValueError(f"weights must be shaped [n, *{tuple(self.weight1.shape[1:])}] and "
                             f"[n, *{tuple(self.weight2.shape[1:])}], got {tuple(w1.shape)} and {tuple(w2.shape)}.")
        if self.float8 is not None:
            counts = tokens_per_expert if rows_per_expert is None else torch.full(
                (w1.shape[0],), rows_per_expert, device=x.device)
            return self.aligned_forward(x, counts, w1, w2, self.float8)
        if backend == "bmm":
            if rows_per_expert is None:
                raise ValueError("backend='bmm' needs rows_per_expert (every expert the same row count).")
            xs = x.reshape(w1.shape[0], rows_per_expert, -1)
            h = _activate(torch.bmm(xs, w1.transpose(1, 2)), self.activation)
            return torch.bmm(h, w2.transpose(1, 2)).reshape(x.shape[0], -1)
        if backend == "grouped_mm":
            offs = tokens_per_expert.cumsum(0).to(torch.int32)
            h = _activate(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs), self.activation)
            return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        sizes = tokens_per_expert.tolist()   # free on CPU; the fallback's one sync on a GPU
        outs = [F.linear(_activate(F.linear(rows, w1[i]), self.activation), w2[i])
                for i, rows in enumerate(x.split(sizes, dim=0))]
        return torch.cat(outs, dim=0) if outs else x.new_zeros(0, self.hidden_size)

    def aligned_forward(self, x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor,
                        grouped_mm: AlignedGroupedMatmul) -> Tensor:
        """Both projections through ``grouped_mm`` on the aligned layout (zero rows between groups), then
        the real rows back in their order."""
        aligned, rows, offsets = align_groups(x, counts, grouped_mm.alignment)
        h = _activate(grouped_mm(aligned, w1.transpose(1, 2), offsets), self.activation)
        return grouped_mm(h, w2.transpose(1, 2), offsets).index_select(0, rows)

    def extra_repr(self) -> str:
        return (f"local_experts={self.num_local_experts} (from {self.first_expert}), hidden={self.hidden_size}, "
                f"ffn={self.ffn_hidden_size} (etp {self.etp_size}), activation={self.activation}, "
                f"backend={self.backend}" + (f", float8={self.float8!r}" if self.float8 is not None else ""))


class SharedExpertMLP(nn.Module):
    """A dense MLP every token goes through, added to the routed experts' output (DeepSeek).

    It runs on the dense side: column- then row-parallel over the tp group, with the layer's
    sequence parallelism, so its input and output have the MoE layer's layout.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "swiglu",
                 sequence_parallel: bool = False, init_method: Optional[InitMethod] = None,
                 output_layer_init_method: Optional[InitMethod] = None, params_dtype: torch.dtype = torch.float32,
                 device: Optional[Union[torch.device, str]] = None,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
        n = 2 if activation == "swiglu" else 1
        self.activation = activation
        self.fc1 = ColumnParallelLinear(hidden_size, n * ffn_hidden_size, bias=False, stride=n,
                                        sequence_parallel=sequence_parallel, init_method=init_method,
                                        params_dtype=params_dtype, device=device, group=group)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=False, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel,
                                     init_method=output_layer_init_method or init_method,
                                     params_dtype=params_dtype, device=device, group=group)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(_activate(self.fc1(x), self.activation))
