"""Rank generator and ParallelLayout: seed 000/001 worked examples, properties, other orders, errors."""

from itertools import product

import pytest

from lightning_megatron.parallel import ParallelConfigError, ParallelLayout, RankGenerator
from lightning_megatron.parallel.__main__ import main as print_layout
from lightning_megatron.parallel.topology import masked_orthogonal_groups

# --- seed 000: 16 GPUs, TP2 x PP4 (DP2), initialize_model_parallel's docstring and printout ----------


def test_seed000_tp2_pp4_groups():
    layout = ParallelLayout(16, tp=2, pp=4)
    assert layout.dp == 2
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.groups("mp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert layout.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert layout.groups("position_embedding") == [[0], [1], [2], [3]]
    # "rank 2's pipeline group is [g2, g6, g10, g14]"
    assert layout.group_of("pp", 2) == [2, 6, 10, 14]


# --- seed 001: 16 GPUs, dense TP4-PP2-DP2 and MoE ETP1-PP2-EP4-EDP2 ----------------------------------


def test_seed001_dense_tp4_pp2_dp2():
    gen = RankGenerator(tp=4, ep=1, dp=2, pp=2, cp=1)
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert gen.get_ranks("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gen.get_ranks("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


def test_seed001_expert_etp1_pp2_ep4_edp2():
    layout = ParallelLayout(16, tp=4, pp=2, ep=4, etp=1)
    assert (layout.etp, layout.ep, layout.edp) == (1, 4, 2)
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.groups("etp") == [[r] for r in range(16)]
    expert_pp = [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert layout.expert_generator.get_ranks("pp") == expert_pp == layout.groups("pp")
    # MoE folding: attention still sees the dense TP4 groups on the same ranks.
    assert layout.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_seed001_global_rank_formulas():
    # dense: tp + cp*tp + dp*tp*cp + pp*tp*cp*dp;  MoE: etp + ep*etp + edp*etp*ep + pp*etp*ep*edp
    layout = ParallelLayout(48, tp=2, cp=2, pp=3, ep=4, etp=1)
    tp, cp, dp, pp, etp, ep, edp = 2, 2, 4, 3, 1, 4, 4
    assert (layout.dp, layout.edp) == (dp, edp)
    for rank in range(48):
        c = layout.coords(rank)
        assert rank == c["tp"] + c["cp"] * tp + c["dp"] * tp * cp + c["pp"] * tp * cp * dp
        assert rank == c["etp"] + c["ep"] * etp + c["edp"] * etp * ep + c["pp"] * etp * ep * edp


def test_masked_groups_enumerate_unmasked_axes_leftmost_fastest():
    # sizes (2, 3, 2): groups of axis 1 are indexed by (axis0, axis2) with axis0 fastest.
    assert masked_orthogonal_groups([2, 3, 2], [False, True, False]) == [
        [0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert masked_orthogonal_groups([2, 3, 2], [True, False, True]) == [
        [0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]


# --- properties over every layout of many world sizes -----------------------------------------------

DENSE_AXES = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}
EXPERT_AXES = {"etp": "etp", "ep": "ep", "edp": "edp"}
COMPOSITES = {"dp-cp": ("dp", "cp"), "tp-cp": ("tp", "cp"), "tp-dp": ("tp", "dp"),
              "tp-dp-cp": ("tp", "dp", "cp"), "mp": ("tp", "pp"), "tp-pp": ("tp", "pp"),
              "tp-ep": ("etp", "ep"), "tp-ep-pp": ("etp", "ep", "pp")}


def all_layouts(world_size, order="tp-cp-ep-dp-pp"):
    """Every layout of ``world_size`` that ``order`` can express (pp groups of both grids agreeing)."""
    axes = order.split("-")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp, pp, cp, ep, etp in product(divisors, repeat=5):
        if world_size % (tp * cp * pp) or world_size % (etp * ep * pp):
            continue
        dp, edp = world_size // (tp * cp * pp), world_size // (etp * ep * pp)
        sizes = {"tp": max(tp, etp), "pp": pp, "cp": cp, "ep": ep, "dp": max(dp, edp)}
        if any(size > 1 and axis not in axes for axis, size in sizes.items()):
            continue
        try:
            yield ParallelLayout(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
        except ParallelConfigError as err:
            assert "different pipeline groups" in str(err) and not order.endswith("pp")


def check_layout(layout):
    world = list(range(layout.world_size))
    coords = [layout.coords(r) for r in world]
    size = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp,
            "etp": layout.etp, "ep": layout.ep, "edp": layout.edp}
    for name, axes in [(n, (n,)) for n in {**DENSE_AXES, **EXPERT_AXES}] + list(COMPOSITES.items()):
        groups = layout.groups(name)
        assert sorted(r for g in groups for r in g) == world, f"{name} groups do not partition the world"
        expected = 1
        for axis in axes:
            expected *= size[axis]
        assert all(len(g) == expected for g in groups), name
        # members of one group agree on every other axis of their grid
        grid = EXPERT_AXES if set(axes) & set(EXPERT_AXES) else DENSE_AXES
        others = [a for a in list(grid) + ["pp"] if a not in axes]
        for g in groups:
            assert len({tuple(coords[r][a] for a in others) for r in g}) == 1, name
    for axis in size:
        for group in layout.groups(axis):
            # a rank's coordinate is its position in its group of that axis
            assert [coords[r][axis] for r in group] == list(range(size[axis])), axis
    # rank -> coords -> rank through the strides of each grid
    strides = {}
    order = layout.order.split("-")
    dense = [a for a in order if a in ("tp", "cp", "dp", "pp")]
    expert = [{"tp": "etp", "dp": "edp"}.get(a, a) for a in order if a in ("tp", "ep", "dp", "pp")]
    for grid in (dense, expert):
        stride = 1
        for axis in grid:
            strides[axis] = stride
            stride *= size[axis]
        for r in world:
            assert sum(coords[r][a] * strides[a] for a in grid) == r
    for emb, pos, pp in zip(layout.groups("embedding"), layout.groups("position_embedding"), layout.groups("pp")):
        assert emb == sorted({pp[0], pp[-1]}) and pos == [pp[0]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8, 12, 16, 24])
def test_properties_hold_for_every_layout(world_size):
    layouts = list(all_layouts(world_size))
    assert layouts
    for layout in layouts:
        check_layout(layout)


@pytest.mark.parametrize("order", ["tp-pp-dp", "pp-dp-tp", "tp-cp-dp-pp", "dp-tp-cp-pp",
                                   "tp-pp-ep-dp", "ep-tp-dp-cp-pp", "pp-tp-cp-ep-dp"])
def test_other_orders_keep_the_properties(order):
    for world_size in (8, 12):
        layouts = list(all_layouts(world_size, order))
        assert len(layouts) > 3
        for layout in layouts:
            check_layout(layout)


def test_order_tp_pp_dp_puts_pipeline_before_data():
    layout = ParallelLayout(8, tp=2, pp=2, order="tp-pp-dp")
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.coords(6) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1, "etp": 0, "ep": 0, "edp": 1}


def test_context_and_expert_parallel_fold_over_the_same_ranks():
    layout = ParallelLayout(8, cp=2, ep=4, etp=1)
    assert layout.groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp-cp") == [list(range(8))]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


# --- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=16, tp=3), r"world_size=16 .* is not divisible by tensor_model_parallel_size \(tp\)=3 × "
     r"context_parallel_size \(cp\)=1 × pipeline_model_parallel_size \(pp\)=1 = 3"),
    (dict(world_size=8, tp=2, cp=2, pp=4), r"\(tp\)=2 × context_parallel_size \(cp\)=2 × "
     r"pipeline_model_parallel_size \(pp\)=4 = 16"),
    (dict(world_size=8, tp=2, ep=8), r"not divisible by expert_tensor_parallel_size \(etp\)=2 × "
     r"expert_model_parallel_size \(ep\)=8 × pipeline_model_parallel_size \(pp\)=1 = 16"),
    (dict(world_size=8, tp=0), r"tp must be >= 1, got 0"),
    (dict(world_size=8, pp=-2), r"pp must be >= 1"),
    (dict(world_size=8, tp=2.0), r"tp must be a positive integer, got 2.0 \(float\)"),
    (dict(world_size=8, ep="2"), r"ep must be a positive integer, got '2' \(str\)"),
    (dict(world_size=8, cp=True), r"cp must be a positive integer, got True \(bool\)"),
    (dict(world_size=0), r"world_size must be >= 1"),
    (dict(world_size=8, etp=3), r"\(etp\)=3 × expert_model_parallel_size \(ep\)=1 × .* = 3"),
    (dict(world_size=8, order="tp-xp-dp-pp"), r"unknown axes \['xp'\]"),
    (dict(world_size=8, order="tp-dp-tp-pp"), r"repeats axes \['tp'\]"),
    (dict(world_size=8, order=""), r"order must be a string"),
    (dict(world_size=8, cp=2, order="tp-dp-pp"), r"lacks 'cp' but that axis has size 2"),
    (dict(world_size=8, tp=2, ep=2, etp=1, order="tp-pp-cp-ep-dp", pp=2),
     r"different pipeline groups .* put 'pp' last"),
])
def test_layout_errors_name_the_parameter(kwargs, match):
    with pytest.raises(ParallelConfigError, match=match):
        ParallelLayout(**kwargs)


def test_rank_generator_rejects_ep_with_cp():
    with pytest.raises(ParallelConfigError, match="ep=2 and cp=2 cannot both exceed 1 in one rank generator"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2)


def test_rank_generator_requires_sized_axes_in_order():
    with pytest.raises(ParallelConfigError, match="dp=2 but order 'tp-pp' does not contain 'dp'"):
        RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp")
    assert RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=1, order="tp-pp").get_ranks("pp") == [[0, 2], [1, 3]]


def test_unknown_group_name_and_bad_rank():
    layout = ParallelLayout(4, tp=2)
    with pytest.raises(ParallelConfigError, match="unknown group name 'tensor'"):
        layout.groups("tensor")
    with pytest.raises(ParallelConfigError, match=r"rank must be in \[0, 4\), got 4"):
        layout.coords(4)


# --- the layout printer -------------------------------------------------------------------------------


def test_layout_printer_prints_groups(capsys):
    assert print_layout(["--world-size", "16", "--tp", "4", "--pp", "2", "--ep", "4", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp (4): [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]" in out
    assert "edp (8): [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]" in out


def test_layout_printer_reports_bad_configuration(capsys):
    assert print_layout(["--world-size", "6", "--tp", "4"]) == 2
    assert "not divisible by tensor_model_parallel_size (tp)=4" in capsys.readouterr().err
