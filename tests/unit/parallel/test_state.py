"""ParallelState on real gloo worlds: every group works, teardown works, bad input fails on every rank."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.parallel import (
    GROUP_NAMES, ParallelLayout, ParallelState, get_parallel_state, has_parallel_state,
)
from lightning_megatron.testing import run_on_ranks

LAYOUTS = {
    1: [dict()],
    2: [dict(tp=2), dict(pp=2), dict(cp=2), dict(ep=2)],
    4: [dict(tp=2, pp=2), dict(tp=2, cp=2), dict(pp=2, ep=2, etp=1), dict(tp=2, ep=2, order="tp-pp-ep-dp")],
    8: [dict(tp=2, pp=2, cp=2), dict(tp=2, pp=2, ep=2), dict(pp=2, ep=4, etp=1), dict(tp=2, pp=4)],
}


def _check_every_group(layouts):
    rank = dist.get_rank()
    report = []
    for kwargs in layouts:
        layout = ParallelLayout(dist.get_world_size(), **kwargs)
        state = ParallelState(layout, virtual_pipeline_size=2 if layout.pp > 1 else None).activate()
        assert get_parallel_state() is state
        for name in GROUP_NAMES:
            ranks = state.ranks(name)
            if not ranks:  # only embedding-like groups may leave a rank out
                assert name in ("embedding", "position_embedding")
                continue
            assert ranks == layout.group_of(name, rank)
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value, group=state.group(name))
            assert value.item() == sum(r + 1 for r in ranks), (name, ranks, value)
            assert dist.get_world_size(state.group(name)) == len(ranks)
            assert state.rank_in(name) == ranks.index(rank)
        assert (state.tp_rank, state.pp_rank, state.dp_rank, state.cp_rank) == tuple(
            state.rank_in(n) for n in ("tp", "pp", "dp", "cp"))
        assert (state.ep_rank, state.etp_rank, state.edp_rank) == tuple(
            state.rank_in(n) for n in ("ep", "etp", "edp"))
        pp = state.ranks("pp")
        assert state.next_pipeline_rank == pp[(pp.index(rank) + 1) % len(pp)]
        assert state.prev_pipeline_rank == pp[(pp.index(rank) - 1) % len(pp)]
        assert state.is_pipeline_first_stage(ignore_virtual=True) == (rank == pp[0])
        assert state.is_pipeline_last_stage(ignore_virtual=True) == (rank == pp[-1])
        if state.virtual_pipeline_size:
            with state.running_chunk(1):
                assert state.virtual_pipeline_rank == 1
                assert not state.is_pipeline_first_stage()
                assert state.is_pipeline_last_stage() == (rank == pp[-1])
            assert state.virtual_pipeline_rank == 0 and state.is_pipeline_first_stage() == (rank == pp[0])
        assert state.in_embedding_group == (rank in (pp[0], pp[-1]))
        report.append((kwargs, state.coords))
        state.destroy()
        assert not has_parallel_state()
        with pytest.raises(RuntimeError, match="destroyed"):
            state.group("tp")
    return report


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_group_sums_and_tears_down(world_size):
    out = run_on_ranks(_check_every_group, world_size, LAYOUTS[world_size], timeout=120)
    for rank, report in enumerate(out):
        for kwargs, coords in report:
            assert coords == ParallelLayout(world_size, **kwargs).coords(rank)


def _error_on_every_rank(kwargs, state_kwargs):
    try:
        ParallelState(ParallelLayout(**kwargs), **state_kwargs)
    except (ValueError, RuntimeError) as err:
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("kwargs, state_kwargs, match", [
    (dict(world_size=4, tp=3), {}, "is not divisible by tensor_model_parallel_size (tp)=3"),
    (dict(world_size=4, cp=2, order="tp-dp-pp"), {}, "lacks 'cp'"),
    (dict(world_size=8, tp=2), {}, "does not match the running world of 4 processes"),
    (dict(world_size=4, tp=2), dict(virtual_pipeline_size=2), "needs pipeline parallelism"),
    (dict(world_size=4, pp=2), dict(virtual_pipeline_size=0), "virtual_pipeline_size must be a positive"),
])
def test_bad_configuration_fails_identically_on_every_rank(kwargs, state_kwargs, match):
    out = run_on_ranks(_error_on_every_rank, 4, kwargs, state_kwargs, timeout=60)
    assert out[0] is not None and match in out[0][1]
    assert all(o == out[0] for o in out)


def test_no_active_state_explains_how_to_get_one():
    assert not has_parallel_state()
    with pytest.raises(RuntimeError, match="no ParallelState is active"):
        get_parallel_state()


def test_state_needs_an_initialized_world():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelState(ParallelLayout(1))


def _logs_over_the_pipeline():
    import torch.distributed as dist

    from lightning_megatron.engine.logs import broadcast_from_last_stage

    state = ParallelState(ParallelLayout(dist.get_world_size(), pp=2)).activate()
    try:
        logs, error, host = {}, None, None
        if state.is_pipeline_last_stage(ignore_virtual=True):
            logs = {"loss": (torch.tensor(2.5), "mean"), "acc": (torch.tensor(0.25), "max")}
            error = ("TypeError", "what the last stage could not log")
            host = {"meta": {"loss": (("a",), {"sync_dist": True})}}
        got, error, host = broadcast_from_last_stage(logs, state, torch.device("cpu"), error, host)
        return {name: (float(value), op) for name, (value, op) in got.items()}, error, host
    finally:
        state.destroy()


def test_logs_reach_every_stage_names_and_arguments_by_host_values_by_tensor():
    out = run_on_ranks(_logs_over_the_pipeline, 4, timeout=60)
    expected = {"loss": (2.5, "mean"), "acc": (0.25, "max")}
    assert out == [(expected, ("TypeError", "what the last stage could not log"),
                    {"meta": {"loss": (("a",), {"sync_dist": True})}})] * 4
