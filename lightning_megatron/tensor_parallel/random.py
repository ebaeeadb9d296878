"""Model-parallel random numbers (seed 002, appendix B.2) and RNG-exact activation checkpointing.

Dropout outside tensor-parallel regions (after the residual adds) must draw the same mask on
every tp rank, since those activations are replicated: the default generator is seeded with
the same seed everywhere. Dropout inside a tp region (attention probabilities of this rank's
heads) must differ between ranks: it runs under ``tracker.fork()``, a separate generator state
seeded per tp rank.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
# Offsets as in Megatron-LM, so seeds line up with runs users compare against.
_TP_SEED_OFFSET = 2718
_EP_SEED_OFFSET = 1024


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in around a region with ``fork(name)``.

    Tracks the generator of the device compute runs on (CUDA when available, else CPU).

    Graph-safe mode (:meth:`enable_graph_safe`, CUDA only): each state lives in a CUDA generator of
    its own that ``fork`` swaps in by pointer (``graphsafe_set_state``). Swapping byte states
    (``set_rng_state``) is refused while a CUDA graph captures and would not be replayed anyway;
    swapped generators can be registered with a graph, whose replays then advance exactly the
    stream eager execution would. ``states`` keeps its keys; the byte API (``get_states`` /
    ``set_states``) reads and writes the generators in place, so graphs stay registered.
    """

    def __init__(self, device_type: Optional[str] = None) -> None:
        self.device_type = device_type or _device_type()
        self.states: Dict[str, torch.Tensor] = {}
        self.seeds: Dict[int, str] = {}
        self.graph_safe = False
        self.generators: Dict[str, torch.Generator] = {}

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()
        self.generators.clear()

    def enable_graph_safe(self) -> None:
        """Move every state into a generator ``fork`` swaps by pointer (see the class doc); idempotent."""
        if self.graph_safe:
            return
        if self.device_type != "cuda":
            raise RuntimeError("RNGStatesTracker.enable_graph_safe() needs the CUDA generator "
                               f"(device_type={self.device_type!r}); CUDA graphs only exist on CUDA devices.")
        self.graph_safe = True
        for name, state in self.states.items():
            self.generators[name] = self._new_generator(state)

    def graph_generators(self) -> List[torch.Generator]:
        """The generators a CUDA graph must register (``CUDAGraph.register_generator_state``)."""
        return list(self.generators.values())

    @staticmethod
    def _new_generator(state: torch.Tensor) -> torch.Generator:
        generator = torch.cuda.default_generators[torch.cuda.current_device()].clone_state()
        generator.set_state(state)
        return generator

    def get_states(self) -> Dict[str, torch.Tensor]:
        if self.graph_safe:
            return {name: gen.get_state() for name, gen in self.generators.items()}
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        if self.graph_safe:
            for name in [n for n in self.generators if n not in states]:
                del self.generators[name]
            for name, state in states.items():
                if name in self.generators:
                    self.generators[name].set_state(state)   # in place: registered graphs keep it
                else:
                    self.generators[name] = self._new_generator(state)
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() before seeding again.")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already used by RNG state {self.seeds[seed]!r}; "
                             "two states with one seed would draw identical numbers.")
        original = _get_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(self.device_type, original)
        self.seeds[seed] = name
        if self.graph_safe:
            self.generators[name] = self._new_generator(self.states[name])

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the state ``name`` inside the block; the default generator is untouched."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call model_parallel_seed(seed) first "
                           f"(known states: {sorted(self.states)}).")
        if self.graph_safe:
            default = torch.cuda.default_generators[torch.cuda.current_device()]
            previous = default.graphsafe_get_state()
            default.graphsafe_set_state(self.generators[name])
            try:
                yield
            finally:
                default.graphsafe_set_state(previous)
            return
        original = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, original)


# one tracker per set of process groups (a ParallelState), living as long as it does
_TRACKERS: "weakref.WeakKeyDictionary[Any, RNGStatesTracker]" = weakref.WeakKeyDictionary()
INITIAL_SEED = 1234


def get_rng_tracker(state: Any = None) -> RNGStatesTracker:
    """The named generator states (seed 002, appendix B.2) of ``state`` (default: the active
    ``ParallelState``): made on first use, seeded per tp/ep rank from ``INITIAL_SEED`` so forks work at
    once; ``model_parallel_seed`` (the strategy: the world's one seed) reseeds them. Kept here, not on
    the state, so the groups know nothing of random numbers."""
    if state is None:
        from ..parallel import get_parallel_state

        state = get_parallel_state()
    tracker = _TRACKERS.get(state)
    if tracker is None:
        tracker = RNGStatesTracker()
        seed_tracker(tracker, INITIAL_SEED, state.tp_rank, state.ep_rank, state.etp_rank)
        _TRACKERS[state] = tracker
    return tracker


def model_parallel_seed(seed: int, tracker: Optional[RNGStatesTracker] = None, tp_rank: Optional[int] = None,
                        ep_rank: Optional[int] = None, etp_rank: Optional[int] = None) -> None:
    """Seed the default generators identically on every tp rank and the tracker per tp/ep rank.

    Ranks default to the active ParallelState's.
    """
    if tracker is None or tp_rank is None or ep_rank is None or etp_rank is None:
        from ..parallel import get_parallel_state

        state = get_parallel_state()
        tracker = get_rng_tracker(state) if tracker is None else tracker
        tp_rank = state.tp_rank if tp_rank is None else tp_rank
        ep_rank = state.ep_rank if ep_rank is None else ep_rank
        etp_rank = state.etp_rank if etp_rank is None else etp_rank
    torch.manual_seed(seed)  # CPU and every CUDA device: the data-parallel (replicated) stream
    seed_tracker(tracker, seed, tp_rank, ep_rank, etp_rank)


def seed_tracker(tracker: RNGStatesTracker, seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """(Re)create the tracker's tp-rank and ep-rank states; the default generators are untouched."""
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + _EP_SEED_OFFSET + 100 * ep_rank + etp_rank)


def checkpoint(function: Callable[..., Any], *args: Any, tracker: Optional[RNGStatesTracker] = None,
               **kwargs: Any) -> Any:
    """Activation checkpointing whose recomputation replays the same random numbers.

    torch's checkpoint restores the CPU and CUDA default generators; this also restores the
    tracker's named states, so dropout inside tensor-parallel regions recomputes bit-identically.
    """
    if tracker is None:
        from ..parallel import has_parallel_state

        tracker = get_rng_tracker() if has_parallel_state() else None
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    saved: Dict[str, Dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def record() -> Iterator[None]:
        saved["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        current = tracker.get_states()
        tracker.set_states(saved["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (record(), replay()), **kwargs)
