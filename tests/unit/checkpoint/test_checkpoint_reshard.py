"""A checkpoint saved at one layout loads at others: parameters and Adam state exactly, same losses."""

import torch

from lightning_megatron.checkpoint import load_sharded, save_sharded
from lightning_megatron.testing import run_on_ranks
from helpers.checkpoint_utils import activate, assert_same, batches, build_gpt, global_view, run

# uneven splits by hand (``pipeline_layout``): the layers move between stages and chunks, empty ones included
LOAD_LAYOUTS = [dict(tp=1), dict(tp=2), dict(pp=2, vpp=2), dict(tp=4), dict(pp=4),
                dict(pp=2, pipeline_layout=[3, 1]), dict(pp=4, pipeline_layout=[0, 2, 1, 1]),
                dict(pp=2, vpp=2, pipeline_layout=[1, 2, 0, 1])]


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _save_at_tp2_pp2_then_load_everywhere(path):
    state = activate(tp=2, pp=2)
    model = build_gpt(state)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches()
    for _ in range(2):
        run(model, state, data, optimizer)
    saved = global_view(model, optimizer, state)
    loss = run(model, state, data)
    save_sharded(path, model, optimizer, extra_state={"global_step": 2})
    run(model, state, data, optimizer)            # the uninterrupted run goes on one step
    loss_next = run(model, state, data)

    for layout in LOAD_LAYOUTS:
        split = layout.get("pipeline_layout")
        state = activate(**{k: v for k, v in layout.items() if k != "pipeline_layout"})
        model = build_gpt(state, pipeline_layout=split, init_seed=99)    # other weights: the load does all the work
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        assert load_sharded(path, model, optimizer) == {"global_step": 2}
        assert_same(global_view(model, optimizer, state), saved)
        _close(run(model, state, data), loss, f"loss after loading at {layout}")
        run(model, state, data, optimizer)        # resumed training uses the resharded Adam state
        _close(run(model, state, data), loss_next, f"loss one step after loading at {layout}")
    return len(saved)


def test_tp2_pp2_checkpoint_loads_at_every_layout(tmp_path):
    counts = run_on_ranks(_save_at_tp2_pp2_then_load_everywhere, 4, str(tmp_path / "ckpt"), timeout=180)
    assert counts[0] > 20      # parameters and their exp_avg/exp_avg_sq/step
