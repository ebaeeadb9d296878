"""Layer split over pipeline stages and virtual chunks: seed 000/003 examples, Megatron-Core's
uneven first/last stages, properties over a grid, and errors."""

import pytest

from lightning_megatron.parallel import ParallelConfigError
from lightning_megatron.parallel.stages import (
    chunk_layer_range, layer_offset, layers_per_chunk, stage_layer_ranges, virtual_stage,
)


def layers(num_layers, pp, rank, vp=None, first=None, last=None):
    return [list(r) for r in stage_layer_ranges(num_layers, pp, rank, vp, first, last)]


# --- seed 000: ParallelTransformer's offsets ----------------------------------------------------

def test_seed000_eight_layers_two_stages_four_chunks():
    assert layers(8, 2, 0, vp=4) == [[0], [2], [4], [6]]
    assert layers(8, 2, 1, vp=4) == [[1], [3], [5], [7]]


def test_seed000_eight_layers_two_stages_two_chunks():
    assert layers(8, 2, 0, vp=2) == [[0, 1], [4, 5]]
    assert layers(8, 2, 1, vp=2) == [[2, 3], [6, 7]]


def test_seed000_contiguous_without_virtual_stages():
    assert [layers(8, 2, r) for r in range(2)] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_seed000_offset_formula_on_a_grid():
    # offset = vp_rank * (num_layers // vp) + pp_rank * (num_layers // pp // vp)
    for pp in range(1, 6):
        for vp in range(1, 5):
            for n in range(pp * vp, 6 * pp * vp + 1, pp * vp):
                for rank in range(pp):
                    for k in range(vp):
                        expected = k * (n // vp) + rank * (n // pp // vp)
                        assert layer_offset(n, pp, rank, vp, k) == expected


def test_seed003_thirty_two_layers_pp4_vpp2():
    expected = {0: [range(0, 4), range(16, 20)], 1: [range(4, 8), range(20, 24)],
                2: [range(8, 12), range(24, 28)], 3: [range(12, 16), range(28, 32)]}
    for rank, ranges in expected.items():
        assert stage_layer_ranges(32, 4, rank, 2) == ranges
    assert [virtual_stage(4, r, k) for k in range(2) for r in range(4)] == list(range(8))


# --- uneven first / last stage (Megatron-Core's decoder_{first,last}_pipeline_num_layers) ------

def test_uneven_first_and_last_stage():
    assert layers_per_chunk(10, 4, first_stage_layers=1, last_stage_layers=3) == (1, 3, 3, 3)
    assert [layers(10, 4, r, first=1, last=3) for r in range(4)] == [
        [[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]


def test_uneven_with_virtual_stages_matches_megatron_core_offsets():
    # 16 layers, pp 4, vp 2, 2 layers on each end: chunk sizes (1, 3, 3, 1), 8 layers per round.
    assert layers_per_chunk(16, 4, 2, 2, 2) == (1, 3, 3, 1)
    assert [layers(16, 4, r, 2, 2, 2) for r in range(4)] == [
        [[0], [8]], [[1, 2, 3], [9, 10, 11]], [[4, 5, 6], [12, 13, 14]], [[7], [15]]]
    # Megatron-Core: vp_stage * (n // vp) + first // vp + (rank - 1) * (middle_per_chunk)
    assert layer_offset(16, 4, 2, 2, 1, 2, 2) == 1 * 8 + 2 // 2 + (2 - 1) * 3


def test_uneven_first_only_and_last_only():
    assert layers_per_chunk(10, 4, first_stage_layers=1) == (1, 3, 3, 3)
    assert layers_per_chunk(7, 3, last_stage_layers=1) == (3, 3, 1)
    assert chunk_layer_range(7, 3, 2, last_stage_layers=1) == range(6, 7)


def test_uneven_empty_first_stage_and_no_middle_stage():
    # a first stage with only the embedding; two stages with both ends pinned
    assert [layers(6, 3, r, first=0) for r in range(3)] == [[[]], [[0, 1, 2]], [[3, 4, 5]]]
    assert layers_per_chunk(8, 2, first_stage_layers=3, last_stage_layers=5) == (3, 5)


# --- properties: the chunks tile the model in virtual-stage order -----------------------------

def test_chunks_tile_the_model_in_virtual_stage_order():
    checked = 0
    pins = [None, 0, 1, 2, 3, 4, 6]
    for n in range(1, 33):
        for pp in range(1, 7):
            for vp in (None, 2, 3, 4):
                for first in pins:
                    for last in pins:
                        try:
                            sizes = layers_per_chunk(n, pp, vp, first, last)
                        except ParallelConfigError:
                            continue
                        v = vp or 1
                        chain = [chunk_layer_range(n, pp, r, vp, k, first, last)
                                 for k in range(v) for r in range(pp)]
                        assert [x for r in chain for x in r] == list(range(n))
                        assert [len(r) for r in chain] == list(sizes) * v
                        assert [virtual_stage(pp, r, k) for k in range(v) for r in range(pp)] == \
                            list(range(pp * v))
                        middle = [sizes[r] for r in range(pp)
                                  if not (r == 0 and first is not None)
                                  and not (r == pp - 1 and last is not None)]
                        assert len(set(middle)) <= 1
                        if first is not None:
                            assert sizes[0] * v == first
                        if last is not None:
                            assert sizes[-1] * v == last
                        checked += 1
    assert checked > 1000


# --- errors name the parameter and what would work ----------------------------------------------

def test_error_layers_do_not_divide():
    with pytest.raises(ParallelConfigError, match=(
            r"num_layers=10 does not split evenly into pp_size \* vp_size = 4 \* 1 = 4 model "
            r"chunks; use num_layers in \{4, 8, 12\}, pp_size in \{1, 2, 5, 10\}, or "
            r"first_stage_layers/last_stage_layers")):
        layers_per_chunk(10, 4)
    with pytest.raises(ParallelConfigError, match=r"num_layers=8 .* 2 \* 3 = 6 model chunks; use "
                       r"num_layers in \{6, 12\}, vp_size in \{1, 2, 4\}"):
        stage_layer_ranges(8, 2, 0, vp_size=3)


def test_error_pinned_stage_not_a_multiple_of_vp_size():
    with pytest.raises(ParallelConfigError, match=r"first_stage_layers=3 must be a multiple of "
                       r"vp_size=2.*use first_stage_layers in \{0, 2, 4\}"):
        layers_per_chunk(16, 4, 2, first_stage_layers=3)


def test_error_middle_stages_do_not_divide():
    with pytest.raises(ParallelConfigError, match=(
            r"after first_stage_layers=1 and last_stage_layers=2, 7 layers remain for 2 middle "
            r"stage\(s\) x vp_size=1 chunks = 2 chunks.*use num_layers in \{7, 9, 11\} or "
            r"first_stage_layers in \{0, 2, 4\}")):
        layers_per_chunk(10, 4, first_stage_layers=1, last_stage_layers=2)
    with pytest.raises(ParallelConfigError, match=r"after last_stage_layers=3, 7 layers .* "
                       r"last_stage_layers in \{0, 2, 4, 6\}"):
        layers_per_chunk(10, 3, last_stage_layers=3)


def test_error_pins_that_cannot_fit():
    with pytest.raises(ParallelConfigError, match=r"first_stage_layers \+ last_stage_layers = 12 "
                       r"exceeds num_layers=10"):
        layers_per_chunk(10, 4, first_stage_layers=6, last_stage_layers=6)
    with pytest.raises(ParallelConfigError, match=r"with pp_size=2, first_stage_layers=4 and "
                       r"last_stage_layers=4 leave no middle stage for the other 2 layers"):
        layers_per_chunk(10, 2, first_stage_layers=4, last_stage_layers=4)
    with pytest.raises(ParallelConfigError, match=r"first_stage_layers=2 needs pp_size >= 2"):
        layers_per_chunk(10, 1, first_stage_layers=2)


def test_error_ranks_and_sizes():
    with pytest.raises(ParallelConfigError, match=r"pp_rank=2 is out of range for pp_size=2; "
                       r"valid values are 0\.\.1"):
        chunk_layer_range(8, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"vp_rank=2 is out of range for vp_size=2"):
        chunk_layer_range(8, 2, 0, vp_size=2, vp_rank=2)
    with pytest.raises(ParallelConfigError, match=r"vp_rank=1 is out of range for vp_size=1"):
        chunk_layer_range(8, 2, 0, vp_rank=1)
    with pytest.raises(ParallelConfigError, match=r"vp_size must be >= 1, got 0"):
        layers_per_chunk(8, 2, 0)
    with pytest.raises(ParallelConfigError, match=r"num_layers must be an integer >= 1, got '8'"):
        layers_per_chunk("8", 2)
    with pytest.raises(ParallelConfigError, match=r"last_stage_layers must be >= 0, got -1"):
        layers_per_chunk(8, 2, last_stage_layers=-1)
