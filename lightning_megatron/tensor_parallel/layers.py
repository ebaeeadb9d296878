"""Column- and row-parallel linear layers and the vocab-parallel embedding (seed 002, section 3).

Every shard is initialised as the matching slice of one master weight drawn on the CPU from the
default generator, so a model built at TP=N holds exactly the numbers it holds at TP=1.
Parameters carry ``tensor_model_parallel``/``partition_dim``/``partition_stride`` so grad
clipping and checkpoints can tell shards from replicas; replicated parameters whose gradients
are partial under sequence parallelism carry ``sequence_parallel=True``.

The linear layers' local matmul (``local_linear``) is ``F.linear``, or the float8 matmul that
``lightning_megatron.quantization.float8.enable_fp8`` puts in the layer's ``float8`` attribute (torchao's float8
training): the tensor-parallel communication around it is the same either way. For the zero-bubble
pipeline schedule it can defer its weight gradient to a later step (``deferred_wgrad.py``). With sequence
parallelism and ``comm_overlap`` the gather/reduce-scatter around the matmul overlaps it (``comm_overlap.py``;
high-precision matmul only).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .mappings import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, resolve_group, scatter_to_tensor_parallel_region,
)
from .column_backward import SplitGemms, column_parallel_linear
from .comm_overlap import all_gather_linear, linear_reduce_scatter
from .deferred_wgrad import deferrable_linear
from .grad_accumulation import accumulating_linear
from .token_ids import check_ids_in_vocab
from .utils import divide, set_tensor_model_parallel_attributes, vocab_range
from .weight_grad_sink import register_sink_weight

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(std: float = 0.02) -> InitMethod:
    """N(0, std): Megatron's default for every weight."""
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std/sqrt(2·num_layers)) for layers that write into the residual stream."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def init_sharded_(param: torch.Tensor, full_shape: Tuple[int, ...], partition_dim: int,
                  init_method: InitMethod, rank: int, world_size: int, stride: int = 1) -> None:
    """Fill ``param`` with this rank's slice of a master weight of ``full_shape``.

    The master weight is drawn in float32 on the CPU, so every tp size and device consumes the
    generator identically. ``stride`` > 1 handles fused weights (e.g. interleaved QKV) whose
    shard is ``stride`` strided blocks.
    """
    master = torch.empty(full_shape, dtype=torch.float32, device="cpu")   # whatever the default device is
    init_method(master)
    block = divide(full_shape[partition_dim] // world_size, stride, "partition size", by="stride")
    blocks = torch.split(master, block, dim=partition_dim)
    shard = torch.cat(blocks[rank::world_size], dim=partition_dim)
    with torch.no_grad():
        param.copy_(shard)


def _real_rows_only(init_method: InitMethod, rows: int) -> InitMethod:
    """Initialise the first ``rows`` rows as a ``[rows, ...]`` tensor would be; zero the rest."""
    def init(master: torch.Tensor) -> None:
        init_method(master[:rows])
        master[rows:].zero_()
    return init


class _TensorParallelModule(nn.Module):
    """Resolves the tp group lazily, so modules stay copyable and follow the active state."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self._explicit_group = group
        resolved = resolve_group(group)
        self.tp_size = dist.get_world_size(resolved)
        self.tp_rank = dist.get_rank(resolved)

    @property
    def group(self) -> dist.ProcessGroup:
        return resolve_group(self._explicit_group)


class _TensorParallelLinear(_TensorParallelModule):
    """What the column- and row-parallel linears share: this rank's matmul, in high precision or float8."""

    #: this rank's ``(x, weight, bias) -> x @ weight.T + bias`` in float8, put here by
    #: ``lightning_megatron.quantization.float8.enable_fp8``; ``None``: ``F.linear``
    float8: Optional[Callable[..., torch.Tensor]] = None
    #: the weight gradient may wait for the zero-bubble schedule's W step (``deferred_wgrad.py``)
    defer_weight_grad: bool = False
    #: sequence-parallel communication overlapped with the matmul (``comm_overlap.py``; set at construction)
    comm_overlap: bool = False
    #: the weight gradient accumulated by its GEMM (``grad_accumulation.py``): the setting True at construction,
    #: or decided for ``"auto"`` by the strategy (``transformer/grad_accumulation_default.py``)
    accumulate_weight_grads: bool = False
    #: the ``gradient_accumulation_fusion`` asked for: True, False or ``"auto"``
    grad_accumulation_fusion: Union[bool, str] = False

    def _fuse_grad_accumulation(self, setting: Union[bool, str]) -> None:
        self.grad_accumulation_fusion = setting
        self.accumulate_weight_grads = setting is True
        if setting is not False:
            register_sink_weight(self)

    def _overlapped(self) -> bool:
        """Whether this forward takes the overlapped path; float8 and deferred weight gradients refuse it."""
        if not (self.comm_overlap and self.sequence_parallel):
            return False
        if self.float8 is not None or self.defer_weight_grad:
            raise ValueError("tp_comm_overlap=True does not combine with fp8 or pipeline_schedule='zb-h1' yet; "
                             "turn one of them off.")
        return True

    def local_linear(self, x: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ weight.T + bias`` on this rank, no communication: ``F.linear``, or the float8 matmul
        ``enable_fp8`` installed (code that multiplies by a layer's weight itself should call this)."""
        if self.float8 is not None:
            return self.float8(x, weight, bias, own_weight=weight is self.weight)
        if self.defer_weight_grad and weight is self.weight:
            return deferrable_linear(x, weight, bias)
        if self.accumulate_weight_grads and weight is self.weight:
            return accumulating_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _overlap_repr(self) -> str:
        return ", comm_overlap=True" if self.comm_overlap and self.sequence_parallel else ""

    def _float8_repr(self) -> str:
        return "" if self.float8 is None else f", float8={self.float8}"


class ColumnParallelLinear(_TensorParallelLinear):
    """``Y = X A + b`` with ``A`` split by columns: each rank computes its slice of the outputs.

    Input is replicated (f: identity forward, all-reduce backward) or, with
    ``sequence_parallel``, a slice of the sequence (first dim) that is all-gathered first.
    Output stays split along the last dim unless ``gather_output``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 init_method: Optional[InitMethod] = None, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, stride: int = 1, params_dtype: torch.dtype = torch.float32,
                 device: Optional[Union[torch.device, str]] = None, perform_initialization: bool = True,
                 group: Optional[dist.ProcessGroup] = None, comm_overlap: bool = False,
                 grad_accumulation_fusion: Union[bool, str] = False) -> None:
        super().__init__(group)
        self.comm_overlap = comm_overlap
        self._fuse_grad_accumulation(grad_accumulation_fusion)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True; keep the output split and use a RowParallelLinear.")
        if skip_bias_add and gather_output:
            raise ValueError("ColumnParallelLinear: skip_bias_add=True returns this rank's bias shard, "
                             "which does not match a gathered output; set gather_output=False.")
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output_size")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        init_method = init_method or init_method_normal()
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if perform_initialization:
            init_sharded_(self.weight, (output_size, input_size), 0, init_method, self.tp_rank,
                          self.tp_size, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        group = self.group
        if self._overlapped():
            out = all_gather_linear(x, self.weight, None if self.skip_bias_add else self.bias, group)
            return (out, self.bias) if self.skip_bias_add else out
        bias = None if self.skip_bias_add else self.bias
        gemms = self._split_gemms(x)
        if gemms is not None:
            out = column_parallel_linear(x, self.weight, bias, group, self.sequence_parallel, None, gemms)
        elif self._backward_overlapped():
            accumulate_into = (self.weight,) if self.accumulate_weight_grads else None
            out = column_parallel_linear(x, self.weight, bias, group, self.sequence_parallel, accumulate_into)
        else:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True)
            else:
                x = copy_to_tensor_parallel_region(x, group)
            out = self.local_linear(x, self.weight, bias)
        if self.gather_output:
            out = gather_from_tensor_parallel_region(out, group)
        return (out, self.bias) if self.skip_bias_add else out

    def _backward_overlapped(self) -> bool:
        """Whether the input gradient's collective overlaps the weight gradient (``column_backward.py``): at
        tensor-parallel size > 1 with the plain matmul (float8 and deferred weight gradients have their own)."""
        return self.tp_size > 1 and self.float8 is None and not self.defer_weight_grad

    def _split_gemms(self, x: torch.Tensor) -> Optional[SplitGemms]:
        """The float8 matmul's GEMMs one at a time, so its input gradient's collective overlaps the weight gradient
        too (``column_backward.py``): at tensor-parallel size > 1 where it offers them (its weight cast for this
        step), else None."""
        split = getattr(self.float8, "split_gemms", None)
        if self.tp_size == 1 or split is None or self.defer_weight_grad:
            return None
        tokens = x.numel() // x.shape[-1] * (self.tp_size if self.sequence_parallel else 1)   # the gathered input's
        return split(x, self.weight, tokens)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (per rank {self.output_size_per_partition}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}{self._overlap_repr()}{self._float8_repr()}")


class RowParallelLinear(_TensorParallelLinear):
    """``Y = X A + b`` with ``A`` split by rows: each rank holds a slice of the inputs.

    Partial products are summed (g: all-reduce forward, identity backward) or, with
    ``sequence_parallel``, reduce-scattered along the sequence. The bias is added once, after.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: Optional[InitMethod] = None, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, stride: int = 1, params_dtype: torch.dtype = torch.float32,
                 device: Optional[Union[torch.device, str]] = None, perform_initialization: bool = True,
                 group: Optional[dist.ProcessGroup] = None, comm_overlap: bool = False,
                 grad_accumulation_fusion: Union[bool, str] = False) -> None:
        super().__init__(group)
        self.comm_overlap = comm_overlap
        self._fuse_grad_accumulation(grad_accumulation_fusion)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                             "(its input comes split from a ColumnParallelLinear).")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        init_method = init_method or init_method_normal()
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if perform_initialization:
            init_sharded_(self.weight, (output_size, input_size), 1, init_method, self.tp_rank,
                          self.tp_size, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]  # runtime attribute
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        group = self.group
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, group)
        if self._overlapped():
            out = linear_reduce_scatter(x, self.weight, group)
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(self.local_linear(x, self.weight), group)
        else:
            out = reduce_from_tensor_parallel_region(self.local_linear(x, self.weight), group)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (per rank {self.input_size_per_partition}), out={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}{self._overlap_repr()}{self._float8_repr()}")


class VocabParallelEmbedding(_TensorParallelModule):
    """Embedding table split along the vocabulary: rank r holds rows [r·V/tp, (r+1)·V/tp).

    Ids outside this rank's rows look up zeros and the partial results are summed over tp (or
    reduce-scattered along the first dim with ``sequence_parallel``: pass ids sequence-first,
    ``[s, b]``, to get ``[s/tp, b, h]``). ``num_embeddings`` must divide by tp: pad it with
    ``pad_vocab_size`` and pass the real ``vocab_size``: rows past it start at zero, so the
    real rows hold the same numbers whatever the padding (and so whatever the tp size).

    Ids outside ``[0, vocab_size)`` (padding rows included) raise a ``ValueError`` naming the id
    and ``vocab_size``, before any communication, so every tp rank raises it. On the CPU always;
    on CUDA the check stays on the device (no host sync per step, but only a generic
    device-side assert) unless ``check_ids=True`` or ``LIGHTNING_MEGATRON_CHECK_IDS=1`` asks for the
    host check and its clear error: see ``lightning_megatron.tensor_parallel.token_ids``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method: Optional[InitMethod] = None,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device: Optional[Union[torch.device, str]] = None, perform_initialization: bool = True,
                 group: Optional[dist.ProcessGroup] = None, vocab_size: Optional[int] = None,
                 check_ids: Optional[bool] = None) -> None:
        super().__init__(group)
        if vocab_size is not None and not 0 < vocab_size <= num_embeddings:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, num_embeddings={num_embeddings}].")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_size = vocab_size or num_embeddings
        self.check_ids = check_ids   # None: on the host on the CPU, on the device on CUDA (see token_ids)
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.tp_rank, self.tp_size)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        init_method = _real_rows_only(init_method or init_method_normal(), self.vocab_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        # rows past it are tp-dependent padding (checkpoints drop them)
        self.weight.vocab_size = self.vocab_size  # type: ignore[attr-defined]  # runtime attribute
        if perform_initialization:
            init_sharded_(self.weight, (num_embeddings, embedding_dim), 0, init_method, self.tp_rank,
                          self.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids_in_vocab(ids, self.vocab_size, padded_vocab_size=self.num_embeddings, check=self.check_ids)
        group = self.group
        if self.tp_size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, group)
        return reduce_from_tensor_parallel_region(out, group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"sequence_parallel={self.sequence_parallel}")
