"""A pipeline layout that balances the stages' costs (pure: integers in, layer counts out).

The model's layers are cut, in order, into ``pp_size * vp_size`` contiguous chunks (virtual stage ``v``
on stage ``v % pp_size``); the first chunk also carries the embedding's cost and the last the output
layer's and the loss's. An even split leaves that last stage much slower when the vocabulary is large
(the output layer and loss of a 128k-vocabulary 1B Llama cost about four layers), and the whole pipeline
runs at the pace of its slowest stage.

``balanced_layout`` minimises, in this order: the slowest stage (the sum of its chunks' costs), the
slowest chunk (one tick of the schedule), and the spread of chunk costs (sum of squares, so equal costs
give the even split). Without virtual stages the first two are the same and the answer is exact (two
dynamic programmes over the prefix sums); with them, the chunk-optimal split is improved by moving
one or two layers at a time from chunk to chunk while that lowers the three in order (a local search). Ties keep the earlier layers
on earlier chunks. Every rank computes the same answer from the same numbers.
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ._checks import check_int
from .stages import check_layout, split_layout
from .topology import ParallelConfigError

__all__ = ["PipelineLayout", "StackCosts", "balanced_layout", "chunk_costs", "resolve_layout", "stage_costs"]

PipelineLayout = Union[None, str, Sequence[int]]          # what a model's ``pipeline_layout`` argument takes
StackCosts = Tuple[Sequence[int], int, int]               # (every layer's cost, the first chunk's extra, the last's)

_PAIR_MOVES_UP_TO = 240   # single moves (16 chunks); beyond, pairs of moves cost seconds and only single ones run


def chunk_costs(layout: Sequence[int], layer_costs: Sequence[int], first_cost: int = 0,
                last_cost: int = 0) -> List[int]:
    """Cost of every virtual stage of ``layout``: its layers, plus the ends' extra costs."""
    prefix = [0, *accumulate(layer_costs)]
    starts = [0, *accumulate(layout)]
    costs = [prefix[starts[v + 1]] - prefix[starts[v]] for v in range(len(layout))]
    costs[0] += first_cost
    costs[-1] += last_cost
    return costs


def stage_costs(layout: Sequence[int], layer_costs: Sequence[int], pp_size: int, first_cost: int = 0,
                last_cost: int = 0) -> List[int]:
    """Cost of every pipeline stage: the sum of its virtual stages' costs (virtual stage ``v`` on ``v % pp``)."""
    totals = [0] * pp_size
    for v, cost in enumerate(chunk_costs(layout, layer_costs, first_cost, last_cost)):
        totals[v % pp_size] += cost
    return totals


def balanced_layout(layer_costs: Sequence[int], pp_size: int, vp_size: Optional[int] = None,
                    first_cost: int = 0, last_cost: int = 0) -> Tuple[int, ...]:
    """Layers per virtual stage (model order) that balance the stages; see the module docstring.

    ``layer_costs[i]``: layer ``i``'s cost (any unit, the same for all: counted training FLOPs);
    ``first_cost`` / ``last_cost``: what the first / last chunk runs besides its layers (embedding;
    output layer and loss).
    """
    pp = check_int("pp_size", pp_size)
    vp = 1 if vp_size is None else check_int("vp_size", vp_size)
    costs = [check_int("layer cost", c, minimum=0) for c in layer_costs]
    check_int("first_cost", first_cost, minimum=0)
    check_int("last_cost", last_cost, minimum=0)
    if not costs:
        raise ParallelConfigError("balanced_layout needs at least one layer.")
    chunks = pp * vp
    bound = _min_max_chunk(costs, chunks, first_cost, last_cost)
    layout = _min_spread(costs, chunks, first_cost, last_cost, bound)
    return _improve_stages(layout, costs, pp, first_cost, last_cost) if vp > 1 else layout


def _segment(prefix: List[int], start: int, end: int, chunk: int, chunks: int, first: int, last: int) -> int:
    """Cost of layers ``[start, end)`` as chunk ``chunk`` of ``chunks``."""
    return prefix[end] - prefix[start] + (first if chunk == 0 else 0) + (last if chunk == chunks - 1 else 0)


def _min_max_chunk(costs: List[int], chunks: int, first: int, last: int) -> int:
    """The smallest possible cost of the slowest chunk (dynamic programme over chunk count x layers used)."""
    n, prefix = len(costs), [0, *accumulate(costs)]
    inf = float("inf")
    best: List[float] = [_segment(prefix, 0, i, 0, chunks, first, last) for i in range(n + 1)]
    for chunk in range(1, chunks):
        best = [min(max(best[j], _segment(prefix, j, i, chunk, chunks, first, last)) for j in range(i + 1))
                if i or chunk < chunks - 1 else inf for i in range(n + 1)]
    return int(best[n])


def _min_spread(costs: List[int], chunks: int, first: int, last: int, bound: int) -> Tuple[int, ...]:
    """The split with every chunk within ``bound`` and the smallest sum of squared chunk costs; ties keep
    layers on earlier chunks (the smallest split point wins)."""
    n, prefix = len(costs), [0, *accumulate(costs)]
    inf = float("inf")
    # score[i]: best sum of squares of chunks 0..chunk covering layers [0, i); cut[chunk][i]: where the chunk starts
    score: List[float] = []
    cuts: List[List[int]] = []
    for i in range(n + 1):
        c = _segment(prefix, 0, i, 0, chunks, first, last)
        score.append(c * c if c <= bound else inf)
    cuts.append([0] * (n + 1))
    for chunk in range(1, chunks):
        new_score, cut = [], []
        for i in range(n + 1):
            best, where = inf, 0
            for j in range(i + 1):
                c = _segment(prefix, j, i, chunk, chunks, first, last)
                if c <= bound and score[j] + c * c < best:
                    best, where = score[j] + c * c, j
            new_score.append(best)
            cut.append(where)
        score = new_score
        cuts.append(cut)
    layout, end = [], n
    for chunk in range(chunks - 1, -1, -1):
        start = cuts[chunk][end] if chunk else 0
        layout.append(end - start)
        end = start
    return tuple(reversed(layout))


def _improve_stages(layout: Tuple[int, ...], costs: List[int], pp: int, first: int, last: int) -> Tuple[int, ...]:
    """Move one layer from a chunk to another (the chunks between keep their counts and shift), or (up to 16
    chunks) two such moves at once, while that lowers (slowest stage, slowest chunk, spread): a local search."""
    def key(candidate: Sequence[int]) -> Tuple[int, int, int]:
        chunk = chunk_costs(candidate, costs, first, last)
        stage = stage_costs(candidate, costs, pp, first, last)
        return max(stage), max(chunk), sum(c * c for c in chunk)

    chunks = range(len(layout))
    moves = [(source, target) for source in chunks for target in chunks if source != target]

    def moved(start: List[int], steps: Sequence[Tuple[int, int]]) -> Optional[List[int]]:
        candidate = list(start)
        for source, target in steps:
            if not candidate[source]:
                return None
            candidate[source] -= 1
            candidate[target] += 1
        return candidate

    current, current_key = list(layout), key(layout)
    while True:
        better = None
        pairs = [[m, n] for m in moves for n in moves if n[0] != m[1]] if len(moves) <= _PAIR_MOVES_UP_TO else []
        for steps in [[m] for m in moves] + pairs:
            candidate = moved(current, steps)
            if candidate is not None and key(candidate) < current_key:
                better = candidate
                break
        if better is None:
            return tuple(current)
        current, current_key = better, key(better)


def resolve_layout(pipeline_layout: PipelineLayout, num_layers: int, pp_size: int, vp_size: Optional[int] = None,
                   costs: Optional[Callable[[], StackCosts]] = None, first_stage_layers: Optional[int] = None,
                   last_stage_layers: Optional[int] = None, default: str = "even") -> Tuple[int, ...]:
    """A stack's ``pipeline_layout`` argument as layers per virtual stage (model order), one error naming it
    (raised the same on every rank: the inputs are the same). None: ``default`` ("balanced" for the models, which
    count their own costs; "even" for a user's stack) unless ``first_stage_layers``/``last_stage_layers`` pin the
    even split's ends; "even"; "balanced" (``costs()`` gives the numbers, called only then); or a list."""
    pinned = first_stage_layers is not None or last_stage_layers is not None
    vp = vp_size if vp_size and vp_size > 1 else None
    if pipeline_layout is None:
        pipeline_layout = "even" if pinned or pp_size == 1 else default
    elif pinned:
        raise ParallelConfigError(
            f"pipeline_layout={pipeline_layout!r} and first_stage_layers/last_stage_layers both say how to split the "
            f"layers: give one of them (pipeline_layout=[...] gives every stage its count).")
    if pipeline_layout == "even":
        return split_layout(num_layers, pp_size, vp, first_stage_layers, last_stage_layers)
    if pipeline_layout == "balanced":
        if pp_size == 1:
            return (num_layers,)
        if costs is None:
            raise ParallelConfigError("pipeline_layout='balanced' needs the layers' costs (layer_costs=[...], one "
                                      "number per layer); or give pipeline_layout as a list.")
        layers, first, last = costs()
        if len(layers) != num_layers:
            raise ParallelConfigError(f"pipeline_layout='balanced' got {len(layers)} layer costs for num_layers="
                                      f"{num_layers}: give one number per layer.")
        return _balanced(tuple(int(c) for c in layers), pp_size, vp or 1, int(first), int(last))
    return check_layout(pipeline_layout, num_layers, pp_size, vp)


@functools.lru_cache(maxsize=64)
def _balanced(layers: Tuple[int, ...], pp: int, vp: int, first: int, last: int) -> Tuple[int, ...]:
    """Every chunk of every rank asks for the same layout: compute it once."""
    return balanced_layout(layers, pp, vp, first, last)
