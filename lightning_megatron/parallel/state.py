"""The process groups of one ``ParallelLayout`` on the running world, and the one accessor to them.

Every rank creates every group, in the same order (``torch.distributed.new_group`` is a
collective over the whole world), and keeps the ones it belongs to. Rank lists shared by
several names (``tp-cp`` is ``tp`` when cp=1) become one process group.
"""

from __future__ import annotations

import contextlib
import contextvars
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist

from .topology import DENSE_GROUP_NAMES, EXPERT_GROUP_NAMES, PIPELINE_DERIVED_NAMES, ParallelLayout

GROUP_NAMES: Tuple[str, ...] = DENSE_GROUP_NAMES + EXPERT_GROUP_NAMES + PIPELINE_DERIVED_NAMES


class ParallelState:
    """Process groups, ranks and sizes of the current rank for every group of ``layout``.

    Create it after ``torch.distributed.init_process_group`` on every rank, then
    ``activate()`` it so layers find it through :func:`get_parallel_state`.
    """

    def __init__(self, layout: ParallelLayout, backend: Optional[str] = None,
                 timeout: Optional[timedelta] = None,
                 virtual_pipeline_size: Optional[int] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelState needs torch.distributed to be initialized first: call "
                "torch.distributed.init_process_group(...) on every rank (the strategy does this)."
            )
        world = dist.get_world_size()
        if layout.world_size != world:
            raise ValueError(
                f"ParallelLayout(world_size={layout.world_size}) does not match the running world "
                f"of {world} processes; build the layout with world_size={world}."
            )
        if virtual_pipeline_size is not None:
            if isinstance(virtual_pipeline_size, bool) or not isinstance(virtual_pipeline_size, int) \
                    or virtual_pipeline_size < 1:
                raise ValueError(
                    f"virtual_pipeline_size must be a positive integer or None, got "
                    f"{virtual_pipeline_size!r}."
                )
            if virtual_pipeline_size > 1 and layout.pp == 1:
                raise ValueError(
                    f"virtual_pipeline_size={virtual_pipeline_size} needs pipeline parallelism "
                    "(pp > 1); set pp >= 2 or drop virtual_pipeline_size."
                )
        self.layout = layout
        self.rank = dist.get_rank()
        self.world_size = world
        self.coords: Dict[str, int] = layout.coords(self.rank)
        self.virtual_pipeline_size = virtual_pipeline_size
        self._ranks: Dict[str, List[int]] = {}
        self._groups: Dict[str, dist.ProcessGroup] = {}
        # rank tuple -> what new_group returned: a ProcessGroup, or torch's NON_GROUP_MEMBER sentinel (an int)
        # for groups this rank is not in; None once destroyed
        self._created: Optional[Dict[Tuple[Any, ...], Any]] = {}
        kwargs: Dict[str, Any] = {}
        if backend is not None:
            kwargs["backend"] = backend
        if timeout is not None:
            kwargs["timeout"] = timeout
        for name in GROUP_NAMES:
            for ranks in layout.groups(name):
                key = tuple(ranks)
                if key not in self._created:
                    self._created[key] = dist.new_group(ranks, **kwargs)
                if self.rank in ranks:
                    self._ranks[name] = ranks
                    self._groups[name] = self._created[key]
        # what the last pipeline stage logged (names, arguments) reaches the other stages host to host:
        # pickled objects over NCCL would make both sides wait for their GPUs every step
        self._pp_host_group: Optional[dist.ProcessGroup] = None
        if layout.pp > 1:
            host = dict(kwargs, backend="gloo")
            for ranks in layout.groups("pp"):
                made = self._created[tuple(ranks)] if dist.get_backend() == "gloo" else dist.new_group(ranks, **host)
                self._created.setdefault(("host",) + tuple(ranks), made)
                if self.rank in ranks:
                    self._pp_host_group = made

    # -- generic access ------------------------------------------------------------------------
    def group(self, name: str) -> dist.ProcessGroup:
        """This rank's process group called ``name`` (see ``ParallelLayout.groups``)."""
        self._check_alive()
        if name not in self._groups:
            if name in GROUP_NAMES:
                raise ValueError(f"rank {self.rank} belongs to no {name!r} group.")
            raise ValueError(f"unknown group name {name!r}; known names: {list(GROUP_NAMES)}.")
        return self._groups[name]

    def ranks(self, name: str) -> List[int]:
        """Global ranks of this rank's group ``name``; empty if it belongs to none (embedding)."""
        if name not in GROUP_NAMES:
            raise ValueError(f"unknown group name {name!r}; known names: {list(GROUP_NAMES)}.")
        return list(self._ranks.get(name, []))

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def rank_in(self, name: str) -> int:
        """Position of this rank in its group ``name``."""
        ranks = self.ranks(name)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} belongs to no {name!r} group.")
        return ranks.index(self.rank)

    # -- the names layers use most -------------------------------------------------------------
    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    cp_size = property(lambda self: self.layout.cp)
    dp_size = property(lambda self: self.layout.dp)
    ep_size = property(lambda self: self.layout.ep)
    etp_size = property(lambda self: self.layout.etp)
    edp_size = property(lambda self: self.layout.edp)
    tp_rank = property(lambda self: self.coords["tp"])
    pp_rank = property(lambda self: self.coords["pp"])
    cp_rank = property(lambda self: self.coords["cp"])
    dp_rank = property(lambda self: self.coords["dp"])
    ep_rank = property(lambda self: self.coords["ep"])
    etp_rank = property(lambda self: self.coords["etp"])
    edp_rank = property(lambda self: self.coords["edp"])
    tp_group = property(lambda self: self.group("tp"))
    pp_group = property(lambda self: self.group("pp"))
    cp_group = property(lambda self: self.group("cp"))
    dp_group = property(lambda self: self.group("dp"))
    dp_cp_group = property(lambda self: self.group("dp-cp"))
    ep_group = property(lambda self: self.group("ep"))
    etp_group = property(lambda self: self.group("etp"))
    edp_group = property(lambda self: self.group("edp"))

    # -- pipeline ------------------------------------------------------------------------------
    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.virtual_pipeline_size and self.virtual_pipeline_rank != 0:
            return False
        return self.pp_rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        if (not ignore_virtual and self.virtual_pipeline_size
                and self.virtual_pipeline_rank != self.virtual_pipeline_size - 1):
            return False
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_host_group(self) -> dist.ProcessGroup:
        """A CPU (gloo) group over this rank's pipeline stages, for Python objects known on the host."""
        self._check_alive()
        if self._pp_host_group is None:
            raise ValueError("pp_host_group exists only under pipeline parallelism (pp > 1).")
        return self._pp_host_group

    @property
    def next_pipeline_rank(self) -> int:
        """Global rank of the next stage (wrapping around, as the interleaved schedule needs)."""
        ranks = self.ranks("pp")
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def prev_pipeline_rank(self) -> int:
        ranks = self.ranks("pp")
        return ranks[(self.pp_rank - 1) % len(ranks)]

    @property
    def virtual_pipeline_rank(self) -> Optional[int]:
        """The chunk the schedule is running (``running_chunk``); None without virtual stages."""
        return _RUNNING_CHUNK.get() if self.virtual_pipeline_size else None

    @contextlib.contextmanager
    def running_chunk(self, vp_rank: int) -> Iterator[None]:
        """Inside, ``VirtualChunks`` and ``is_pipeline_first/last_stage()`` see local chunk ``vp_rank``. The
        chunk is step context (a context variable), not part of the state: the groups stay immutable."""
        if not self.virtual_pipeline_size:
            raise ValueError("running_chunk needs virtual_pipeline_size to be set.")
        if not 0 <= vp_rank < self.virtual_pipeline_size:
            raise ValueError(f"virtual pipeline rank must be in [0, {self.virtual_pipeline_size}), got {vp_rank}.")
        token = _RUNNING_CHUNK.set(vp_rank)
        try:
            yield
        finally:
            _RUNNING_CHUNK.reset(token)

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self._ranks.get("embedding", [])

    # -- lifetime ------------------------------------------------------------------------------
    def activate(self) -> "ParallelState":
        """Make this the state that :func:`get_parallel_state` returns."""
        global _ACTIVE
        self._check_alive()
        _ACTIVE = self
        return self

    def destroy(self) -> None:
        """Destroy every group this state created (collective: call it on every rank)."""
        global _ACTIVE
        if self._created is None:
            return
        for group in dict.fromkeys(self._created.values()):   # a gloo world's host groups are its pp groups
            # after a failed rank aborted every communicator (distributed/failure.py) none is left to destroy
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and dist.is_initialized():
                dist.destroy_process_group(group)
        self._created = None
        self._groups = {}
        if _ACTIVE is self:
            _ACTIVE = None

    def _check_alive(self) -> None:
        if self._created is None:
            raise RuntimeError("this ParallelState was destroyed; build a new one.")

    def __repr__(self) -> str:
        l = self.layout
        return (f"ParallelState(rank={self.rank}, tp={l.tp}, cp={l.cp}, dp={l.dp}, pp={l.pp}, "
                f"etp={l.etp}, ep={l.ep}, edp={l.edp}, coords={self.coords})")


_ACTIVE: Optional[ParallelState] = None
_RUNNING_CHUNK: contextvars.ContextVar[int] = contextvars.ContextVar("running_chunk", default=0)


def get_parallel_state() -> ParallelState:
    """The active ``ParallelState``; the one place layers look up their groups."""
    if _ACTIVE is None:
        raise RuntimeError(
            "no ParallelState is active: run under Trainer(strategy='megatron'), or build one with "
            "ParallelState(ParallelLayout(world_size, tp=...)).activate()."
        )
    return _ACTIVE


def has_parallel_state() -> bool:
    return _ACTIVE is not None


def chunk_position(vp_rank: int = 0) -> Tuple[bool, bool]:
    """(is first chunk of the whole model, is last chunk) for this rank's local chunk ``vp_rank``."""
    state = get_parallel_state()
    vp_size = state.virtual_pipeline_size or 1
    if not 0 <= vp_rank < vp_size:
        raise ValueError(f"vp_rank={vp_rank} is out of range for virtual_pipeline_size={vp_size}.")
    first = state.pp_rank == 0 and vp_rank == 0
    last = state.pp_rank == state.pp_size - 1 and vp_rank == vp_size - 1
    return first, last
