"""At setup the strategy says which layers every pipeline stage holds (global rank 0, once per layout)."""

import logging

from lightning_megatron.adapter.pipeline_report import describe_layout
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import fit_tiny_gpt


def test_describe_layout_lists_every_stage_and_its_chunks():
    assert describe_layout((5, 5, 5, 1), 4) == ("stage 0: 5 layers (0-4) | stage 1: 5 layers (5-9) | "
                                                "stage 2: 5 layers (10-14) | stage 3: 1 layer (15)")
    assert describe_layout((1, 2, 0, 1), 2) == "stage 0: 1 layer (0, -) | stage 1: 3 layers (1-2, 3)"


def _fit_and_capture(layout):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("lightning.pytorch").addHandler(Keep(level=logging.INFO))   # Lightning's: not propagated
    fit_tiny_gpt(dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, micro_batch_size=2),
                 max_steps=1, module_kwargs=dict(pipeline_layout=layout))
    return [line for line in records if line.startswith("pipeline layout")]


def test_the_chosen_layout_is_logged_at_setup_on_rank_zero():
    rank0, rank1 = run_on_ranks(_fit_and_capture, 2, [1, 2, 0, 1], timeout=120)
    assert rank0 == ["pipeline layout [1, 2, 0, 1]: stage 0: 1 layer (0, -) | stage 1: 3 layers (1-2, 3)"]
    assert rank1 == []
