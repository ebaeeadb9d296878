"""Batched point-to-point exchanges between neighbouring pipeline stages, on gloo and NCCL.

One :meth:`PipelineP2P.communicate` call is one ``batch_isend_irecv``: everything a rank sends
to and receives from its two neighbours at one point of the schedule goes into a single batch
that the neighbours match with their own single call. Separate blocking calls would deadlock
(gloo's send waits for the receiver; NCCL queues both directions of a pair on one stream), and
NCCL pairs messages by order, so the order inside a batch is fixed: send to next, send to
previous, receive from previous, receive from next. A sender's "to next" then lines up with
its receiver's "from previous" even at ``pp_size == 2``, where both neighbours are one rank.

Neighbours wrap around (the last stage's next is the first stage), which interleaved schedules
use to pass chunk ``k``'s output to chunk ``k + 1``.

Shapes are known up front (``tensor_shape``) or, with ``variable_seq_lengths``, sent first in a
small batch of their own, so the receiver can allocate its buffer before the payload arrives.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

MAX_NDIM = 8  # variable-shape mode sends shapes as a fixed-size header: ndim, then the dims


def _received(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    """What ``communicate`` returns for a direction it was asked to receive from: never None."""
    assert tensor is not None
    return tensor


class PipelineP2P:
    """Sends and receives activations/gradients with the previous and next pipeline stage.

    ``group`` is the pipeline group (default: the active ``ParallelState``'s ``pp_group``);
    ``device`` defaults to the current CUDA device on NCCL and the CPU otherwise.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 tensor_shape: Optional[Sequence[int]] = None, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, variable_seq_lengths: bool = False) -> None:
        if group is None:
            from ..parallel import get_parallel_state  # the one accessor to process groups

            group = get_parallel_state().pp_group
        size = dist.get_world_size(group)
        if size < 2:
            raise ValueError(
                f"PipelineP2P needs a pipeline group of at least 2 ranks, got {size}; with "
                f"pp_size=1 there is no neighbour to talk to (run without pipelining).")
        if tensor_shape is None and not variable_seq_lengths:
            raise ValueError(
                "PipelineP2P: pass tensor_shape (e.g. (seq_len, micro_batch_size, hidden)) so "
                "receivers can allocate buffers, or set variable_seq_lengths=True to send the "
                "shape ahead of every tensor.")
        self.group = group
        self.tensor_shape = None if tensor_shape is None else torch.Size(tensor_shape)
        self.dtype = dtype
        self.variable_seq_lengths = variable_seq_lengths
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu") \
            if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:  # compare equal to tensors' devices
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        rank = dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)

    # -- the one primitive ---------------------------------------------------------------------
    def communicate(self, *, send_next: Optional[torch.Tensor] = None,
                    send_prev: Optional[torch.Tensor] = None, recv_prev: bool = False,
                    recv_next: bool = False
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Exchange with both neighbours in one batch; return (from previous, from next).

        ``send_next`` goes to the next stage's ``recv_prev``; ``send_prev`` to the previous
        stage's ``recv_next``. Returns when every transfer of the batch is complete, so sent
        tensors may be freed or changed afterwards.
        """
        for name, tensor in (("send_next", send_next), ("send_prev", send_prev)):
            if tensor is not None:
                self._check_sent(name, tensor)
        if self.variable_seq_lengths:
            shape_prev, shape_next = self._exchange_shapes(send_next, send_prev, recv_prev,
                                                           recv_next)
        else:
            shape_prev = shape_next = self.tensor_shape
        from_prev = self._empty(shape_prev) if recv_prev else None
        from_next = self._empty(shape_next) if recv_next else None
        self._batch(
            sends=[(send_next, self.next_rank), (send_prev, self.prev_rank)],
            recvs=[(from_prev, self.prev_rank), (from_next, self.next_rank)])
        return from_prev, from_next

    # -- the usual pairings (Megatron-Core's names) --------------------------------------------
    def send_forward(self, output: torch.Tensor) -> None:
        self.communicate(send_next=output)

    def recv_forward(self) -> torch.Tensor:
        return _received(self.communicate(recv_prev=True)[0])

    def send_backward(self, input_grad: torch.Tensor) -> None:
        self.communicate(send_prev=input_grad)

    def recv_backward(self) -> torch.Tensor:
        return _received(self.communicate(recv_next=True)[1])

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        return _received(self.communicate(send_next=output, recv_next=True)[1])

    def send_backward_recv_forward(self, input_grad: torch.Tensor) -> torch.Tensor:
        return _received(self.communicate(send_prev=input_grad, recv_prev=True)[0])

    # -- helpers -------------------------------------------------------------------------------
    def _check_sent(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype:
            raise ValueError(
                f"PipelineP2P.{name}: tensor has dtype {tensor.dtype} but the pipeline was set up "
                f"with dtype={self.dtype}; cast the stage output or pass dtype={tensor.dtype}.")
        if tensor.device != self.device:
            raise ValueError(
                f"PipelineP2P.{name}: tensor is on {tensor.device} but the pipeline exchanges on "
                f"device={self.device}; move the stage output or pass device={tensor.device}.")
        if self.variable_seq_lengths:
            if tensor.dim() > MAX_NDIM:
                raise ValueError(f"PipelineP2P.{name}: {tensor.dim()} dims exceed the {MAX_NDIM} "
                                 f"that variable_seq_lengths supports.")
        elif tensor.shape != self.tensor_shape:
            assert self.tensor_shape is not None  # __init__: given unless variable_seq_lengths
            raise ValueError(
                f"PipelineP2P.{name}: tensor has shape {tuple(tensor.shape)} but "
                f"tensor_shape={tuple(self.tensor_shape)}; fix tensor_shape (with sequence "
                f"parallelism the sequence dim is divided by the tp size) or set "
                f"variable_seq_lengths=True if lengths differ between micro-batches. Through the strategy (the shape "
                f"learned from an earlier step of micro-batches of the same shapes): a stage whose output shape "
                f"depends on the values of its input needs LIGHTNING_MEGATRON_PIPELINE_SHAPES=exchange.")

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        def header(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            values = [t.dim(), *t.shape] + [0] * (MAX_NDIM - t.dim())
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        def buffer(wanted: bool) -> Optional[torch.Tensor]:
            if not wanted:
                return None
            return torch.empty(MAX_NDIM + 1, dtype=torch.int64, device=self.device)

        from_prev, from_next = buffer(recv_prev), buffer(recv_next)
        self._batch(sends=[(header(send_next), self.next_rank),
                           (header(send_prev), self.prev_rank)],
                    recvs=[(from_prev, self.prev_rank), (from_next, self.next_rank)])

        def shape(h: Optional[torch.Tensor]) -> Optional[torch.Size]:
            if h is None:
                return None
            values = h.tolist()
            return torch.Size(values[1:1 + values[0]])

        return shape(from_prev), shape(from_next)

    def _empty(self, shape: torch.Size) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _batch(self, sends: Sequence[Tuple[Optional[torch.Tensor], int]],
               recvs: Sequence[Tuple[Optional[torch.Tensor], int]]) -> None:
        ops: List[dist.P2POp] = []
        for tensor, peer in sends:
            if tensor is not None:
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer, self.group))
        for tensor, peer in recvs:
            if tensor is not None:
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.group))
        if not ops:
            return
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def prepare_group_for_batched_p2p(group: dist.ProcessGroup, device: torch.device) -> None:
    """Run one collective on ``group`` so NCCL has its communicator before batched p2p.

    NCCL's ``batch_isend_irecv`` needs every rank of the group in the first call on that group;
    schedules start with only some ranks talking. Collective: call it on every rank of the group.
    gloo needs nothing.
    """
    if dist.get_backend(group) == "gloo":
        return
    dist.all_reduce(torch.zeros(1, device=device), group=group)
