"""Pipeline point-to-point: the pure communication plan, and batched exchanges on gloo."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.parallel import ParallelConfigError, ParallelLayout, ParallelState
from lightning_megatron.pipeline import PipelineP2P, comm_plan, schedule_steps, virtual_stage
from lightning_megatron.testing import run_on_ranks

# --- the communication plan (pure) ---------------------------------------------------------------

CONFIGS = [  # (num_microbatches, pp_size, num_model_chunks, microbatch_group_size_per_vp_stage)
    (m, pp, 1, None) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 13)
] + [
    (m, pp, c, g) for pp in (2, 3, 4) for c in (2, 3) for g in (None, pp + 1)
    for m in (pp, pp + 1, 2 * pp, 2 * pp + 3, 4 * pp)
    if (g or pp) <= m and (m % (g or pp) == 0 or m % (g or pp) >= pp)
]


@pytest.mark.parametrize("forward_only", [False, True])
def test_comm_plan_pairs_every_message_and_keeps_schedule_order(forward_only):
    for m, pp, c, g in CONFIGS:
        plan = comm_plan(m, pp, c, g, forward_only)
        by_round = [{x.index: x for x in rounds} for rounds in plan]
        last = pp * c - 1
        produced, consumed = {}, {}  # (kind, receiving stage, micro-batch) -> round
        for r in range(pp):
            steps = [x.step for x in plan[r] if x.step is not None]
            assert steps == schedule_steps(m, pp, r, c, g, forward_only), (m, pp, c, g, r)
            assert len(by_round[r]) == len(plan[r])  # at most one step and one exchange a round
            for x in plan[r]:
                nxt = by_round[(r + 1) % pp].get(x.index)
                prv = by_round[(r - 1) % pp].get(x.index)
                # what I send to my next/previous neighbour, it receives in the same round
                assert x.send_next == (nxt is not None and nxt.recv_prev is not None)
                assert x.send_prev == (prv is not None and prv.recv_next is not None)
                if x.step is None:
                    assert not (x.send_next or x.send_prev)
                    continue
                v = virtual_stage(pp, r, x.step.chunk)
                fwd = x.step.is_forward
                assert x.send_next == (fwd and v < last) and x.send_prev == (not fwd and v > 0)
                if x.send_next:
                    produced[("act", v + 1, x.step.microbatch)] = x.index
                    assert nxt.recv_prev == ((v + 1) // pp, x.step.microbatch)
                if x.send_prev:
                    produced[("grad", v - 1, x.step.microbatch)] = x.index
                    assert prv.recv_next == ((v - 1) // pp, x.step.microbatch)
                if fwd and v > 0:
                    consumed[("act", v, x.step.microbatch)] = x.index
                if not fwd and v < last:
                    consumed[("grad", v, x.step.microbatch)] = x.index
        assert produced.keys() == consumed.keys()
        assert all(produced[k] < consumed[k] for k in produced), (m, pp, c, g)


def test_comm_plan_checks_the_schedule():
    with pytest.raises(ParallelConfigError, match="num_microbatches=3 is smaller than pp_size=4"):
        comm_plan(3, 4, 2)
    plan = comm_plan(8, 4, 2)  # seed 003's example: the first rank starts at once, the last waits
    assert plan[0][0].index == 0 and plan[3][0].step is None and plan[3][0].recv_prev == (0, 0)


# --- exchanges on gloo ----------------------------------------------------------------------


def _all_pipeline():
    world = dist.get_world_size()
    return ParallelState(ParallelLayout(world, pp=world)).activate()


def _ring_round_trip():
    """Every rank sends to its next and previous neighbour, in every dtype, around the ring."""
    state = _all_pipeline()
    r, n = state.pp_rank, state.pp_size
    checks = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        comm = PipelineP2P(tensor_shape=(3, 2), dtype=dtype)

        def mine(who, sign, dtype=dtype):  # what rank ``who`` sends forward (+1) / backward (-1)
            return (torch.arange(6).view(3, 2) * sign + 100 * who).to(dtype)

        # forward direction alone: the last stage's output wraps around to the first stage
        from_prev, _ = comm.communicate(send_next=mine(r, 1), recv_prev=True)
        checks[f"{dtype} forward"] = torch.equal(from_prev, mine((r - 1) % n, 1))
        # backward direction alone
        _, from_next = comm.communicate(send_prev=mine(r, -1), recv_next=True)
        checks[f"{dtype} backward"] = torch.equal(from_next, mine((r + 1) % n, -1))
        # both directions in one batch (with pp=2 both neighbours are the same rank)
        from_prev, from_next = comm.communicate(send_next=mine(r, 1), send_prev=mine(r, -1),
                                                recv_prev=True, recv_next=True)
        checks[f"{dtype} both"] = (torch.equal(from_prev, mine((r - 1) % n, 1))
                                   and torch.equal(from_next, mine((r + 1) % n, -1))
                                   and from_prev.dtype == dtype)
    return checks


def _variable_lengths():
    state = _all_pipeline()
    r, n = state.pp_rank, state.pp_size
    comm = PipelineP2P(variable_seq_lengths=True)
    act = torch.full((r + 2, 2, 3), float(r))      # a different sequence length per stage
    grad = torch.full((1, r + 1), -float(r))        # and a different rank of tensor
    from_prev, from_next = comm.communicate(send_next=act, send_prev=grad, recv_prev=True,
                                            recv_next=True)
    p, q = (r - 1) % n, (r + 1) % n
    return (from_prev.shape == (p + 2, 2, 3) and bool((from_prev == p).all())
            and from_next.shape == (1, q + 1) and bool((from_next == -q).all()))


def _one_directional_pairs():
    """Megatron-Core's named pairings match up between the first and the last of 2 stages."""
    state = ParallelState(ParallelLayout(dist.get_world_size(), pp=2)).activate()
    comm = PipelineP2P(tensor_shape=(4,))
    x = torch.arange(4.0)
    if state.pp_rank == 0:
        comm.send_forward(x)
        grad = comm.recv_backward()
        out = comm.send_forward_recv_backward(x + 1)
        comm.send_backward(x * 0)  # wraps around to the last stage's recv_forward
        return torch.equal(grad, -x) and torch.equal(out, -(x + 1))
    act = comm.recv_forward()
    comm.send_backward(-act)
    act2 = comm.send_backward_recv_forward(-(act + 1))
    wrapped = comm.recv_backward()  # the first stage's send_backward: rank 0's "previous" is rank 1
    return torch.equal(act, x) and torch.equal(act2, x + 1) and torch.equal(wrapped, x * 0)


def _errors():
    ParallelState(ParallelLayout(dist.get_world_size(), pp=2)).activate()
    comm = PipelineP2P(tensor_shape=(2, 3))
    messages = []
    for bad in (torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float64)):
        try:
            comm.communicate(send_next=bad)
        except ValueError as error:
            messages.append(str(error))
    try:
        PipelineP2P()
    except ValueError as error:
        messages.append(str(error))
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_round_trip_both_directions_and_wrap_around(world):
    for checks in run_on_ranks(_ring_round_trip, world, timeout=60):
        assert all(checks.values()), checks


def test_variable_seq_lengths_and_named_pairings():
    assert run_on_ranks(_variable_lengths, 3, timeout=60) == [True] * 3
    assert run_on_ranks(_one_directional_pairs, 2, timeout=60) == [True] * 2


def test_errors_name_the_setting_to_change():
    for shape_error, dtype_error, missing in run_on_ranks(_errors, 2, timeout=60):
        assert "tensor_shape=(2, 3)" in shape_error and "variable_seq_lengths=True" in shape_error
        assert "dtype=torch.float32" in dtype_error
        assert "tensor_shape" in missing and "variable_seq_lengths=True" in missing
