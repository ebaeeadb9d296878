"""Which global ranks form which process group: pure integer arithmetic, no torch.distributed.

Seed 001's construction. A rank is a point in a grid of axes listed in ``order`` (leftmost
varies fastest), ``global_rank = sum(index[a] * stride[a])`` with ``stride`` the prefix
product of the sizes. The groups of a token such as ``"tp-dp"`` are obtained by *masking*
those axes: every combination of the unmasked axes names one group, and the masked axes,
enumerated leftmost-fastest, give its members.

Two grids share the world (MoE folding): the dense grid (tp, cp, dp, pp) used by attention
and everything that is not an expert, and the expert grid (etp, ep, edp, pp) used by the
experts. ``ParallelLayout`` builds both and checks that they agree on the pipeline groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Mapping, Sequence, Tuple

AXES: Tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"

DENSE_GROUP_NAMES: Tuple[str, ...] = (
    "tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp", "tp-dp-cp", "tp-pp", "mp", "tp-cp-pp",
    "tp-dp-cp-pp",
)
EXPERT_GROUP_NAMES: Tuple[str, ...] = ("ep", "etp", "edp", "tp-ep", "tp-ep-pp", "etp-ep", "etp-ep-pp")
PIPELINE_DERIVED_NAMES: Tuple[str, ...] = ("embedding", "position_embedding")

# Names on the expert grid, spelled as the user asks for them, to the grid's own axis tokens.
_EXPERT_ALIASES: Mapping[str, str] = {
    "ep": "ep", "etp": "tp", "edp": "dp", "tp-ep": "tp-ep", "etp-ep": "tp-ep",
    "tp-ep-pp": "tp-ep-pp", "etp-ep-pp": "tp-ep-pp",
}
_DENSE_ALIASES: Mapping[str, str] = {"mp": "tp-pp", "world": "tp-cp-dp-pp"}


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot be laid out; the message says what to change."""


def check_size(name: str, value: object) -> int:
    """Return ``value`` as a positive int or raise an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParallelConfigError(
            f"{name} must be a positive integer, got {value!r} ({type(value).__name__}); "
            f"pass e.g. {name}=1."
        )
    if value < 1:
        raise ParallelConfigError(f"{name} must be >= 1, got {value}; use {name}=1 to disable it.")
    return value


def parse_order(order: str) -> List[str]:
    """Split an order string such as ``"tp-cp-ep-dp-pp"`` and check its axis names."""
    if not isinstance(order, str) or not order:
        raise ParallelConfigError(f"order must be a string like {DEFAULT_ORDER!r}, got {order!r}.")
    axes = order.lower().split("-")
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ParallelConfigError(
            f"order {order!r} names unknown axes {unknown}; the axes are {list(AXES)} "
            f"(e.g. order={DEFAULT_ORDER!r})."
        )
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if repeated:
        raise ParallelConfigError(f"order {order!r} repeats axes {repeated}; name each axis once.")
    return axes


def masked_orthogonal_groups(sizes: Sequence[int], mask: Sequence[bool]) -> List[List[int]]:
    """Groups formed by the masked axes of a grid whose axis ``i`` has ``sizes[i]`` entries.

    Axis 0 varies fastest. Each combination of the unmasked axes (enumerated leftmost
    fastest) is one group; its members run over the masked axes, leftmost fastest.
    """
    strides = []
    stride = 1
    for size in sizes:
        strides.append(stride)
        stride *= size
    masked = [i for i, m in enumerate(mask) if m]
    unmasked = [i for i, m in enumerate(mask) if not m]

    def ranks_of(axes: List[int]) -> List[int]:
        # Offsets contributed by ``axes``, leftmost fastest (product() varies the last fastest).
        offsets = [0]
        for axis in axes:
            offsets = [o + k * strides[axis] for k in range(sizes[axis]) for o in offsets]
        return offsets

    return [[base + member for member in ranks_of(masked)] for base in ranks_of(unmasked)]


class RankGenerator:
    """Seed 001's rank generator over the axes tp, cp, ep, dp, pp laid out in ``order``.

    ``get_ranks("tp-pp")`` returns every group of ranks that differ only in their tp and pp
    indices. Axes absent from ``order`` must have size 1.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = DEFAULT_ORDER,
                 rank_offset: int = 0) -> None:
        self.sizes: Dict[str, int] = {
            "tp": check_size("tp", tp), "cp": check_size("cp", cp), "ep": check_size("ep", ep),
            "dp": check_size("dp", dp), "pp": check_size("pp", pp),
        }
        if ep > 1 and cp > 1:
            raise ParallelConfigError(
                f"ep={ep} and cp={cp} cannot both exceed 1 in one rank generator: context "
                "parallelism belongs to the dense grid and expert parallelism to the expert grid. "
                "Use ParallelLayout(world_size, cp=..., ep=...), which folds experts over the "
                "dense ranks (MoE folding)."
            )
        axes = parse_order(order)
        missing: List[str] = []
        for axis in AXES:
            if axis not in axes:
                if self.sizes[axis] != 1:
                    raise ParallelConfigError(
                        f"{axis}={self.sizes[axis]} but order {order!r} does not contain {axis!r}; "
                        f"add it, e.g. order={DEFAULT_ORDER!r}."
                    )
                missing.append(axis)
        self.order = "-".join(axes)
        self.axes: List[str] = axes + missing
        self.rank_offset = rank_offset
        self.world_size = 1
        for size in self.sizes.values():
            self.world_size *= size

    def get_mask(self, token: str) -> List[bool]:
        names = parse_order(token)
        return [axis in names for axis in self.axes]

    def get_ranks(self, token: str) -> List[List[int]]:
        """Every group of ``token`` (e.g. ``"tp"``, ``"dp-cp"``), each a list of global ranks."""
        groups = masked_orthogonal_groups([self.sizes[a] for a in self.axes], self.get_mask(token))
        return [[r + self.rank_offset for r in group] for group in groups]

    def coords(self, rank: int) -> Dict[str, int]:
        """Index of ``rank`` along every axis of this grid."""
        local = rank - self.rank_offset
        if not 0 <= local < self.world_size:
            raise ParallelConfigError(f"rank {rank} is outside this grid of {self.world_size} ranks.")
        out = {}
        for axis in self.axes:
            out[axis] = local % self.sizes[axis]
            local //= self.sizes[axis]
        return out

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in AXES)
        return f"RankGenerator({sizes}, order={self.order!r})"


def _world_size_message(world: int, sizes: Sequence[Tuple[str, str, int]], why: str) -> str:
    """``world_size`` not divisible by a product of sizes: each size by the strategy's argument name
    (and ``ParallelLayout``'s short one), the product, why it must divide, and the ways out."""
    product = 1
    for _, _, value in sizes:
        product *= value
    factors = " × ".join(f"{long} ({short})={value}" for long, short, value in sizes)
    divisors = sorted({d for i in range(1, int(world ** 0.5) + 1) if world % i == 0 for d in (i, world // i)})
    near = [max(d for d in divisors if d < product)] + [d for d in divisors if d > product][:1]
    return (f"world_size={world} (the number of processes: devices × num_nodes) is not divisible by "
            f"{factors} = {product}: {why}. Run on a multiple of {product} processes, or choose sizes whose "
            f"product divides {world} (e.g. {' or '.join(map(str, near))}).")


@dataclass(frozen=True)
class ParallelLayout:
    """Every process group of a world laid out for tp/cp/dp/pp (dense) and etp/ep/edp/pp (experts).

    ``dp = world_size / (tp*cp*pp)`` and ``edp = world_size / (etp*ep*pp)``; ``etp`` defaults
    to ``tp``. The short names are the strategy's ``tensor_model_parallel_size``,
    ``pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size`` and
    ``expert_tensor_parallel_size``; errors give both. All validation happens here, before any
    process group exists, so every rank raises the same error.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        world = check_size("world_size", self.world_size)
        for name in ("tp", "pp", "cp", "ep"):
            check_size(name, getattr(self, name))
        etp = check_size("etp", self.tp if self.etp is None else self.etp)
        object.__setattr__(self, "etp", etp)
        axes = parse_order(self.order)
        object.__setattr__(self, "order", "-".join(axes))

        dense = self.tp * self.cp * self.pp
        if world % dense:
            raise ParallelConfigError(_world_size_message(
                world, (("tensor_model_parallel_size", "tp", self.tp), ("context_parallel_size", "cp", self.cp),
                        ("pipeline_model_parallel_size", "pp", self.pp)),
                "the data-parallel size, world_size / (tp × cp × pp), must be a whole number"))
        expert = etp * self.ep * self.pp
        if world % expert:
            raise ParallelConfigError(_world_size_message(
                world, (("expert_tensor_parallel_size", "etp", etp), ("expert_model_parallel_size", "ep", self.ep),
                        ("pipeline_model_parallel_size", "pp", self.pp)),
                "the expert data-parallel size, world_size / (etp × ep × pp), must be a whole number; "
                "expert_tensor_parallel_size (etp) defaults to tensor_model_parallel_size (tp)"))
        for axis, size in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("dp", self.dp),
                           ("ep", self.ep), ("tp", etp), ("dp", self.edp)):
            if size > 1 and axis not in axes:
                raise ParallelConfigError(
                    f"order {self.order!r} lacks {axis!r} but that axis has size {size}; add it, "
                    f"e.g. order={DEFAULT_ORDER!r}."
                )
        dense_pp = self.dense_generator.get_ranks("pp")
        expert_pp = self.expert_generator.get_ranks("pp")
        if sorted(dense_pp) != sorted(expert_pp):
            raise ParallelConfigError(
                f"order {self.order!r} gives the dense grid (tp={self.tp}, cp={self.cp}, "
                f"dp={self.dp}) and the expert grid (etp={self.etp}, ep={self.ep}, edp={self.edp}) "
                f"different pipeline groups ({dense_pp[0]} vs {expert_pp[0]}, ...); put 'pp' last "
                f"in order (e.g. {DEFAULT_ORDER!r}) or make the axes before pp the same size."
            )

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def _etp(self) -> int:
        """``etp`` as an int: ``__post_init__`` replaced a None with ``tp``."""
        assert self.etp is not None
        return self.etp

    @property
    def edp(self) -> int:
        return self.world_size // (self._etp * self.ep * self.pp)

    @cached_property
    def dense_generator(self) -> RankGenerator:
        return RankGenerator(tp=self.tp, ep=1, dp=self.dp, pp=self.pp, cp=self.cp, order=self.order)

    @cached_property
    def expert_generator(self) -> RankGenerator:
        return RankGenerator(tp=self._etp, ep=self.ep, dp=self.edp, pp=self.pp, cp=1, order=self.order)

    # -- groups --------------------------------------------------------------------------------
    def groups(self, name: str) -> List[List[int]]:
        """All groups called ``name``: a dense token (tp, cp, dp, pp, dp-cp, tp-cp, tp-dp,
        tp-dp-cp, tp-pp, mp, ...), an expert name (ep, etp, edp, tp-ep, tp-ep-pp), or
        ``embedding`` / ``position_embedding``."""
        if name in _EXPERT_ALIASES:
            return self.expert_generator.get_ranks(_EXPERT_ALIASES[name])
        if name == "embedding":
            return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
        if name == "position_embedding":
            return [[g[0]] for g in self.groups("pp")]
        token = _DENSE_ALIASES.get(name, name)
        try:
            axes = parse_order(token)
        except ParallelConfigError:
            axes = None
        if axes is None or "ep" in axes:
            known = DENSE_GROUP_NAMES + EXPERT_GROUP_NAMES + PIPELINE_DERIVED_NAMES
            raise ParallelConfigError(f"unknown group name {name!r}; known names: {list(known)}.")
        return self.dense_generator.get_ranks(token)

    def group_of(self, name: str, rank: int) -> List[int]:
        """The group called ``name`` that contains ``rank`` (empty for embedding groups it is not in)."""
        self._check_rank(rank)
        for group in self.groups(name):
            if rank in group:
                return group
        return []

    def coords(self, rank: int) -> Dict[str, int]:
        """Index of ``rank`` along every axis: tp, cp, dp, pp (dense) and etp, ep, edp (expert)."""
        self._check_rank(rank)
        dense = self.dense_generator.coords(rank)
        expert = self.expert_generator.coords(rank)
        return {"tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
                "etp": expert["tp"], "ep": expert["ep"], "edp": expert["dp"]}

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank must be in [0, {self.world_size}), got {rank!r}.")

    def describe(self) -> str:
        """Multi-line text with every group, as ``python -m lightning_megatron.parallel`` prints it."""
        lines = [
            f"world_size={self.world_size} order={self.order}",
            f"dense:  tp={self.tp} cp={self.cp} dp={self.dp} pp={self.pp}",
            f"expert: etp={self.etp} ep={self.ep} edp={self.edp} pp={self.pp}",
        ]
        names = list(DENSE_GROUP_NAMES[:9]) + ["ep", "etp", "edp", "tp-ep", "tp-ep-pp"]
        names += list(PIPELINE_DERIVED_NAMES)
        for name in names:
            groups = self.groups(name)
            lines.append(f"{name:>18} ({len(groups)}): {groups}")
        return "\n".join(lines)

