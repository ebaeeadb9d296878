"""How a region is captured and replayed: real CUDA graphs, or an eager stand-in with the same contract.

Contract: ``capture(graph, body)`` runs ``body`` once and returns its result with tensors detached
(the *static* result: fixed tensors that each ``replay(graph)`` refreshes in place).

- ``CudaGraphBackend``: ``body`` runs under ``torch.cuda.graph`` on one side stream, into one
  memory pool shared by every graph of the owner (so graphs captured in the order they replay
  reuse each other's freed memory), with the RNG generators registered so dropout inside the graph
  draws what eager execution would. ``weak`` turns a static tensor into a non-owning alias, which
  returns its memory to the pool for later captures while replays still write there.
- ``EagerBackend``: ``replay`` runs ``body`` again and copies the new result into the static one.
  No GPU needed: the CPU tests drive the whole capture/replay bookkeeping through it, and a
  suspected graph bug can be bisected by switching backends.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

from .errors import CudaGraphError
from .tree import map_tensors, tensors_of

BACKENDS = ("cuda", "eager")


class EagerGraph:
    def __init__(self) -> None:
        self.body: Optional[Callable[[], Any]] = None
        self.result: Any = None


class EagerBackend:
    name = "eager"

    def new_graph(self) -> EagerGraph:
        return EagerGraph()

    def capture(self, graph: EagerGraph, body: Callable[[], Any]) -> Any:
        graph.body = body
        graph.result = map_tensors(lambda t: t.detach(), body())
        return graph.result

    def replay(self, graph: EagerGraph) -> None:
        if graph.body is None:
            raise CudaGraphError("replay() of a graph that was never captured.")
        new = graph.body()
        with torch.no_grad():
            for static, fresh in zip(tensors_of(graph.result), tensors_of(new)):
                static.copy_(fresh)

    def weak(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @contextmanager
    def session(self) -> Iterator[None]:
        yield

    def synchronize(self) -> None:
        pass


class CudaGraphBackend:
    name = "cuda"

    def __init__(self, generators: Sequence[torch.Generator] = (), capture_error_mode: str = "thread_local") -> None:
        if not torch.cuda.is_available():
            raise CudaGraphError("CUDA graphs need a CUDA device; none is available (use backend='eager' "
                                 "to run the same bookkeeping without graphs).")
        self.generators: List[torch.Generator] = list(generators)
        if self.generators and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            raise CudaGraphError(
                f"torch {torch.__version__} cannot register extra RNG generators with a CUDA graph "
                "(CUDAGraph.register_generator_state is missing), so dropout under the RNG tracker's fork() "
                "would repeat the captured masks; upgrade torch (>= 2.5) or set hidden_dropout=attention_dropout=0.")
        self.capture_error_mode = capture_error_mode
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def new_graph(self) -> "torch.cuda.CUDAGraph":
        return torch.cuda.CUDAGraph()

    def capture(self, graph: "torch.cuda.CUDAGraph", body: Callable[[], Any]) -> Any:
        for generator in self.generators:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                              capture_error_mode=self.capture_error_mode):
            result = body()
        return map_tensors(lambda t: t.detach(), result)

    def replay(self, graph: "torch.cuda.CUDAGraph") -> None:
        graph.replay()

    def weak(self, tensor: torch.Tensor) -> torch.Tensor:
        return weak_alias(tensor)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Eager work around captures (warm-up, buffer fills) runs on the capture stream too."""
        torch.cuda.synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def weak_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor at ``tensor``'s address that does not keep its memory alive (seed 003's make_weak_ref).

    Once the owner is gone the memory returns to the graph pool and later captures may reuse it;
    valid because graphs replay in the order they were captured.
    """
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes())
    alias = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
    return alias.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def make_backend(name: str, generators: Sequence[torch.Generator] = ()) -> Any:
    if name == "cuda":
        return CudaGraphBackend(generators)
    if name == "eager":
        return EagerBackend()
    raise ValueError(f"backend={name!r} is not one of {BACKENDS}: 'cuda' captures CUDA graphs, 'eager' runs "
                     f"the same bookkeeping without them (CPU tests, debugging).")
