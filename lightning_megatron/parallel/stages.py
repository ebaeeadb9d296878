"""Which transformer layers each pipeline stage and virtual chunk builds (seed 000); pure.

The model is cut, in layer order, into ``pp_size * vp_size`` chunks. Chunk ``v`` (the
*virtual stage*) lives on rank ``v % pp_size`` as its local chunk ``v // pp_size``, so rank
``r``'s local chunk ``k`` is virtual stage ``k * pp_size + r``. With an even split this is
seed 000's ``ParallelTransformer`` offset::

    offset = vp_rank * (num_layers // vp_size) + pp_rank * (num_layers // pp_size // vp_size)

8 layers, pp 2, vp 4: stage 0 builds [0] [2] [4] [6], stage 1 [1] [3] [5] [7];
8 layers, pp 2, vp 2: stage 0 builds [0, 1] [4, 5], stage 1 [2, 3] [6, 7].

An uneven split (Megatron-Core's ``decoder_first_pipeline_num_layers`` /
``decoder_last_pipeline_num_layers``) gives the first and/or last stage a fixed number of
layers (often fewer: they also hold the embedding or the head; 0 is allowed) and splits the
rest evenly over the other ("middle") stages. Every stage spreads its layers evenly over its
``vp_size`` chunks, so each round of virtual stages covers ``num_layers // vp_size`` layers.

A *layout* says it all at once: the number of layers of every virtual stage, in model order
(``pp_size * vp_size`` counts; Megatron-Core's ``pipeline_model_parallel_layout`` in spirit). Every
split above is one (``split_layout``); ``parallel.stage_balance`` computes one from costs, and a
user may give one by hand (``check_layout`` names what is wrong with it).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .topology import ParallelConfigError
from ._checks import check_int, check_rank, listing, nearest


def virtual_stage(pp_size: int, pp_rank: int, vp_rank: int = 0) -> int:
    """Position of rank ``pp_rank``'s local chunk ``vp_rank`` in the model's chain of chunks."""
    return vp_rank * pp_size + pp_rank


def layers_per_chunk(num_layers: int, pp_size: int, vp_size: Optional[int] = None,
                     first_stage_layers: Optional[int] = None,
                     last_stage_layers: Optional[int] = None) -> Tuple[int, ...]:
    """Layers in each virtual chunk of every stage, indexed by ``pp_rank`` (same for all chunks)."""
    n = check_int("num_layers", num_layers)
    pp = check_int("pp_size", pp_size)
    vp = 1 if vp_size is None else check_int("vp_size", vp_size)
    if first_stage_layers is None and last_stage_layers is None:
        if n % (pp * vp):
            ok_n = nearest(lambda v: v % (pp * vp) == 0, n, 1, n + pp * vp)
            other = (f"vp_size in {{{listing(_divisors(n // pp))}}}" if n % pp == 0
                     else f"pp_size in {{{listing(_divisors(n))}}}")
            raise ParallelConfigError(
                f"num_layers={n} does not split evenly into pp_size * vp_size = {pp} * {vp} = "
                f"{pp * vp} model chunks; use num_layers in {{{listing(ok_n)}}}, {other}, or "
                f"first_stage_layers/last_stage_layers for an uneven split."
            )
        return (n // (pp * vp),) * pp
    return _uneven(n, pp, vp, first_stage_layers, last_stage_layers)


def _uneven(n: int, pp: int, vp: int, first: Optional[int], last: Optional[int]) -> Tuple[int, ...]:
    """Per-stage chunk sizes with the first/last stage pinned and the rest spread evenly."""
    fixed = {}
    pins = (("first_stage_layers", first, 0), ("last_stage_layers", last, pp - 1))
    for name, value, rank in pins:
        if value is None:
            continue
        check_int(name, value, minimum=0)
        if pp < 2:
            raise ParallelConfigError(
                f"{name}={value} needs pp_size >= 2 (with pp_size={pp} one stage is the whole "
                f"model); drop {name} or raise pp_size.")
        if value % vp:
            raise ParallelConfigError(
                f"{name}={value} must be a multiple of vp_size={vp}: the stage spreads its layers "
                f"evenly over its {vp} virtual chunks; use {name} in "
                f"{{{listing(nearest(lambda v: v % vp == 0, value, 0, value + vp))}}}.")
        fixed[rank] = value
    middle_ranks = [r for r in range(pp) if r not in fixed]
    middle_layers = n - sum(fixed.values())
    if middle_layers < 0:
        raise ParallelConfigError(
            f"first_stage_layers + last_stage_layers = {sum(fixed.values())} exceeds "
            f"num_layers={n}; they must leave layers for the other stages.")
    per_middle = len(middle_ranks) * vp
    fits = middle_layers % per_middle == 0 if per_middle else middle_layers == 0
    if not fits:
        pinned = " and ".join(f"{'first' if r == 0 else 'last'}_stage_layers={v}"
                              for r, v in sorted(fixed.items()))
        if not per_middle:
            raise ParallelConfigError(
                f"with pp_size={pp}, {pinned} leave no middle stage for the other "
                f"{middle_layers} layers; set first_stage_layers + last_stage_layers = "
                f"num_layers={n}, or raise pp_size.")
        ok_n = nearest(lambda v: (v - sum(fixed.values())) % per_middle == 0, n,
                       sum(fixed.values()), n + per_middle)
        rank, name = (0, "first_stage_layers") if 0 in fixed else (pp - 1, "last_stage_layers")
        others = sum(fixed.values()) - fixed[rank]
        ok_pin = nearest(lambda v: v % vp == 0 and (n - others - v) % per_middle == 0,
                         fixed[rank], 0, n - others)
        raise ParallelConfigError(
            f"after {pinned}, {middle_layers} layers remain for {len(middle_ranks)} middle "
            f"stage(s) x vp_size={vp} chunks = {per_middle} chunks, which does not divide; "
            f"num_layers - first_stage_layers - last_stage_layers must be a multiple of "
            f"{per_middle}: use num_layers in {{{listing(ok_n)}}} or {name} in "
            f"{{{listing(ok_pin)}}}.")
    middle_chunk = middle_layers // per_middle if per_middle else 0
    return tuple(fixed[r] // vp if r in fixed else middle_chunk for r in range(pp))


def _divisors(k: int) -> List[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def split_layout(num_layers: int, pp_size: int, vp_size: Optional[int] = None,
                    first_stage_layers: Optional[int] = None,
                    last_stage_layers: Optional[int] = None) -> Tuple[int, ...]:
    """Layers of every virtual stage in model order (``pp_size * vp_size`` counts) of the even or
    first/last-pinned split."""
    sizes = layers_per_chunk(num_layers, pp_size, vp_size, first_stage_layers, last_stage_layers)
    return sizes * (1 if vp_size is None else vp_size)


def check_layout(layout: object, num_layers: int, pp_size: int, vp_size: Optional[int] = None,
                 name: str = "pipeline_layout") -> Tuple[int, ...]:
    """``layout`` as a tuple if it gives every one of the ``pp_size * vp_size`` virtual stages a count of
    layers >= 0 and they add up to ``num_layers``; else one error naming ``name`` and the fix."""
    n = check_int("num_layers", num_layers)
    pp = check_int("pp_size", pp_size)
    vp = 1 if vp_size is None else check_int("vp_size", vp_size)
    chunks = pp * vp
    order = ("stage 0, stage 1, ..." if vp == 1 else
             f"virtual stage v on stage v % {pp}: stage 0's first chunk, stage 1's first chunk, ..., then "
             f"every stage's second chunk, ...")
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence):
        raise ParallelConfigError(
            f"{name} must be a list of {chunks} layer counts (one per virtual stage, in model order: {order}), "
            f"'balanced' or 'even'; got {layout!r}.")
    counts = tuple(layout)
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ParallelConfigError(f"{name} must hold layer counts (integers >= 0), got {bad[0]!r} in {list(counts)}.")
    if len(counts) != chunks:
        raise ParallelConfigError(
            f"{name} has {len(counts)} entries, but pp_size * vp_size = {pp} * {vp} = {chunks} virtual stages need "
            f"one count each (in model order: {order}).")
    if sum(counts) != n:
        raise ParallelConfigError(
            f"{name}={list(counts)} holds {sum(counts)} layers, but the model has num_layers={n}: the counts must "
            f"add up to it.")
    return counts


def _resolve(num_layers: int, pp_size: int, vp_size: Optional[int], first: Optional[int], last: Optional[int],
             layout: Optional[Sequence[int]]) -> Tuple[int, ...]:
    if layout is None:
        return split_layout(num_layers, pp_size, vp_size, first, last)
    if first is not None or last is not None:
        raise ParallelConfigError(
            "pipeline_layout gives every stage its layers; first_stage_layers/last_stage_layers pin the ends of "
            "another split: give one of them.")
    return check_layout(layout, num_layers, pp_size, vp_size)


def layer_offset(num_layers: int, pp_size: int, pp_rank: int, vp_size: Optional[int] = None,
                 vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None, layout: Optional[Sequence[int]] = None) -> int:
    """Global index of the first layer of ``pp_rank``'s local chunk ``vp_rank``: the layers of every
    virtual stage before it (``vp_rank`` rounds of all stages' chunks, then earlier stages' chunks in this
    round). ``layout``: a per-virtual-stage split (``check_layout``) instead of the even/pinned one."""
    sizes = _resolve(num_layers, pp_size, vp_size, first_stage_layers, last_stage_layers, layout)
    check_rank("pp_rank", pp_rank, "pp_size", pp_size)
    check_rank("vp_rank", vp_rank, "vp_size", 1 if vp_size is None else vp_size)
    return sum(sizes[:virtual_stage(pp_size, pp_rank, vp_rank)])


def chunk_layer_range(num_layers: int, pp_size: int, pp_rank: int, vp_size: Optional[int] = None,
                      vp_rank: int = 0, first_stage_layers: Optional[int] = None,
                      last_stage_layers: Optional[int] = None, layout: Optional[Sequence[int]] = None) -> range:
    """Global (0-based) layer indices that ``pp_rank``'s local chunk ``vp_rank`` builds."""
    start = layer_offset(num_layers, pp_size, pp_rank, vp_size, vp_rank, first_stage_layers,
                         last_stage_layers, layout)
    sizes = _resolve(num_layers, pp_size, vp_size, first_stage_layers, last_stage_layers, layout)
    return range(start, start + sizes[virtual_stage(pp_size, pp_rank, vp_rank)])


def stage_layer_ranges(num_layers: int, pp_size: int, pp_rank: int, vp_size: Optional[int] = None,
                       first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None, layout: Optional[Sequence[int]] = None) -> List[range]:
    """Layer ranges of all of ``pp_rank``'s local chunks, in local chunk order."""
    return [chunk_layer_range(num_layers, pp_size, pp_rank, vp_size, k, first_stage_layers,
                              last_stage_layers, layout)
            for k in range(1 if vp_size is None else vp_size)]
