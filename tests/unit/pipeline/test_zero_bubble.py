"""ZB-H1 (zero-bubble 1F1B): its order checked like the others' (every step once, F before B before W,
dependencies across stages, memory no more than 1F1B's), the bubble it leaves, the communication plan,
the deferred weight gradients of the tensor-parallel linears, and the executor equal to one stage."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.parallel import ParallelConfigError, ParallelLayout, ParallelState
from lightning_megatron.pipeline import comm_plan, forward_backward, schedule_steps
from lightning_megatron.pipeline import allreduce_shared_embedding_grads, sync_shared_embedding_weights
from lightning_megatron.pipeline.schedules import BACKWARD, FORWARD, WEIGHT, ScheduleStep
from lightning_megatron.pipeline.zero_bubble import bubble_fraction, simulated_step_time, zero_bubble_h1_schedule
from lightning_megatron.tensor_parallel.deferred_wgrad import (WeightGradQueue, _owner, collect_weight_grads,
                                                               deferrable_linear, enable_deferred_weight_grads)
from lightning_megatron.testing import run_on_ranks
from helpers.pp_utils import B, H, NUM_LAYERS, S, build_chunks, forward_step, full_grads, microbatches, reference

GRID = [(p, m) for p in range(1, 9) for m in range(1, 19)]


@pytest.mark.parametrize("pp", range(1, 9))
def test_order_properties(pp):
    for m in range(1, 19):
        for r in range(pp):
            steps = zero_bubble_h1_schedule(m, pp, r)
            # every micro-batch once per phase; F, B and W each in micro-batch order
            for phase in (FORWARD, BACKWARD, WEIGHT):
                assert [s.microbatch for s in steps if s.phase == phase] == list(range(m)), (m, r, phase)
            assert all(s.chunk == 0 for s in steps)
            # F before B before W of each micro-batch; memory: between F and W at most min(p, m) (1F1B's stage 0),
            # between F and B no more than 1F1B on this stage
            at = {(s.phase, s.microbatch): i for i, s in enumerate(steps)}
            assert all(at[(FORWARD, i)] < at[(BACKWARD, i)] < at[(WEIGHT, i)] for i in range(m))
            held = pending_b = peak_held = peak_b = 0
            for s in steps:
                held += s.phase == FORWARD
                held -= s.phase == WEIGHT
                pending_b += s.phase == FORWARD
                pending_b -= s.phase == BACKWARD
                peak_held, peak_b = max(peak_held, held), max(peak_b, pending_b)
            assert peak_held <= min(pp, m) and peak_b <= min(pp - r, m), (m, r)
            # without its weight passes, exactly 1F1B's order
            assert [s for s in steps if s.phase != WEIGHT] == schedule_steps(m, pp, r)


@pytest.mark.parametrize("pp, m", GRID)
def test_dependencies_across_stages_hold_and_the_bubble_is_a_third(pp, m):
    steps = [zero_bubble_h1_schedule(m, pp, r) for r in range(pp)]
    time = simulated_step_time(steps)   # raises on a deadlock
    if m >= pp:   # F = B = W = 1: 3m of work, p - 1 of bubble (1F1B: 3(p - 1))
        assert time == 3 * m + pp - 1
    plan = comm_plan(m, pp, schedule="zb-h1")
    assert [[r.step for r in rounds if r.step is not None] for rounds in plan] == steps
    for r, rounds in enumerate(plan):
        for rnd in rounds:
            if rnd.step is not None and rnd.step.phase == WEIGHT:
                assert not (rnd.send_next or rnd.send_prev)
            # what round t sends, the neighbour receives in round t (the pairing the executor needs)
            if rnd.send_next:
                assert any(o.index == rnd.index and o.recv_prev for o in plan[(r + 1) % pp])


def test_simulated_bubbles_against_1f1b():
    """The table really fills the bubble (unit costs; 1F1B's backward = B + W = 2)."""
    table = {(p, m): (round(100 * bubble_fraction(m, p, True), 1), round(100 * bubble_fraction(m, p, False), 1))
             for p, m in [(2, 8), (4, 8), (4, 16), (8, 16)]}
    assert table == {(2, 8): (4.0, 11.1), (4, 8): (11.1, 27.3), (4, 16): (5.9, 15.8), (8, 16): (12.7, 30.4)}


def test_schedule_errors_name_the_argument():
    with pytest.raises(ParallelConfigError, match="pipeline_schedule='zb' is not one of '1f1b', 'zb-h1'"):
        comm_plan(4, 2, schedule="zb")
    with pytest.raises(ParallelConfigError, match="virtual_pipeline_model_parallel_size=2"):
        comm_plan(4, 2, num_model_chunks=2, schedule="zb-h1")
    with pytest.raises(ValueError, match="weight-gradient pass"):
        ScheduleStep(WEIGHT, 0, 0).order_entry
    assert comm_plan(4, 2, forward_only=True, schedule="zb-h1") == comm_plan(4, 2, forward_only=True)


# --- the split backward of the linears --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 5), "transposed"])
@pytest.mark.parametrize("bias", [True, False])
def test_deferred_weight_grad_is_autograds_bit_for_bit(shape, bias):
    torch.manual_seed(0)
    x0 = torch.randn(4, 3, 5).transpose(0, 1) if shape == "transposed" else torch.randn(*shape)
    w = torch.randn(7, 5, requires_grad=True)
    b = torch.randn(7, requires_grad=True) if bias else None
    x = x0.clone().requires_grad_()
    y = F.linear(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    w2 = w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if bias else None
    x2 = x0.clone().requires_grad_()
    fired = []
    w2.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    queue = WeightGradQueue()
    y2 = deferrable_linear(x2, w2, b2)
    assert torch.equal(y2, y)
    with collect_weight_grads(queue):
        y2.backward(g)   # B: input and bias gradients only; no hook of the weight fires
    assert w2.grad is None and not fired and len(queue) == 1
    assert torch.equal(x2.grad, x.grad) and (not bias or torch.equal(b2.grad, b.grad))
    queue.run()      # W: the weight gradient through autograd, its hook with it
    assert torch.equal(w2.grad, w.grad) and len(fired) == 1 and len(queue) == 0


def test_deferred_weight_grad_under_autocast_is_autograds_bit_for_bit():
    torch.manual_seed(0)
    x0, w, b = torch.randn(3, 4, 8), torch.randn(6, 8, requires_grad=True), torch.randn(6, requires_grad=True)
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    w2, b2, x2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_(), x0.clone().requires_grad_()
    queue = WeightGradQueue()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = deferrable_linear(x2, w2, b2)
    with collect_weight_grads(queue):
        y2.backward(g)
    queue.run()
    assert y2.dtype == torch.bfloat16 and torch.equal(y2, y)
    assert torch.equal(x2.grad, x.grad) and torch.equal(b2.grad, b.grad) and torch.equal(w2.grad, w.grad)
    assert w2.grad.dtype == torch.float32


class _TwoDeferringLinears(torch.nn.Module):
    """A layer's shape: norm, a deferring linear, SiLU, another, the residual."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16, bias=True), torch.nn.Linear(16, 8, bias=False)
        self.up.defer_weight_grad = self.down.defer_weight_grad = False   # what the parallel linears carry

    def forward(self, x, deferring=True):
        linear = deferrable_linear if deferring else F.linear
        h = F.silu(linear(F.rms_norm(x, (8,)), self.up.weight, self.up.bias))
        return x + linear(h, self.down.weight, None)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_backward_outside_a_queue_accumulates_at_once_as_autograd_would(backend):
    """Eager, and compiled (the custom op's hand-over runs a re-entrant backward inside the compiled one)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    ref, model = _TwoDeferringLinears(), _TwoDeferringLinears()
    model.load_state_dict(ref.state_dict())
    enable_deferred_weight_grads(model)
    fired = []
    model.down.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    x0 = torch.randn(2, 5, 8)
    ref(x0.clone().requires_grad_(), deferring=False).square().sum().backward()
    forward = model if backend is None else torch.compile(model.forward, backend=backend)
    forward(x0.clone().requires_grad_()).square().sum().backward()   # no B step: nothing waits
    for name in ("up.weight", "down.weight", "up.bias"):
        torch.testing.assert_close(model.get_parameter(name).grad, ref.get_parameter(name).grad, rtol=1e-6,
                                   atol=1e-6)
    # compiled, the graph's own edge to the weight's accumulator fires the hook once more, after, with no new
    # gradient (the data-parallel buffers ignore such a call); eager, only the real one
    assert len(fired) == (1 if backend is None else 2)
    for grad in fired:
        torch.testing.assert_close(grad, ref.down.weight.grad, rtol=1e-6, atol=1e-6)


def test_a_frozen_input_does_not_lose_the_deferred_gradient():
    w, x = torch.randn(3, 2, requires_grad=True), torch.randn(4, 2)
    queue = WeightGradQueue()
    y = deferrable_linear(x, w, None)   # nothing but the weight needs a gradient
    with collect_weight_grads(queue):
        y.sum().backward()
    assert w.grad is None and len(queue) == 1
    queue.run()
    torch.testing.assert_close(w.grad, torch.ones(4, 3).t().mm(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_deferring_linear_stays_in_one_graph_and_defers_exactly(backend):
    """Compiled, the deferring linears are traced (one graph, no break: a break per linear fragments a compiled
    layer, 1.7-2.5x slower on GPUs); B leaves both weights' work in the queue and W gives autograd's gradients."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref, model = _TwoDeferringLinears(), _TwoDeferringLinears()
    model.load_state_dict(ref.state_dict())
    enable_deferred_weight_grads(model)
    x0 = torch.randn(2, 5, 8)
    x = x0.clone().requires_grad_()
    ref(x, deferring=False).square().sum().backward()
    compiled = torch.compile(model.forward, backend=backend)
    queues = [WeightGradQueue() for _ in range(2)]
    for queue in queues:   # twice: the second call runs the cached graph
        x2 = x0.clone().requires_grad_()
        out = compiled(x2)
        with collect_weight_grads(queue):
            out.square().sum().backward()
        assert model.up.weight.grad is None and model.down.weight.grad is None and len(queue) == 2
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.up.bias.grad, ref.up.bias.grad * (1 + (queue is queues[1])),
                                   rtol=1e-6, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    for queue in queues:
        queue.run()
    torch.testing.assert_close(model.up.weight.grad, 2 * ref.up.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.down.weight.grad, 2 * ref.down.weight.grad, rtol=1e-6, atol=1e-6)


def test_a_compiled_deferring_linear_under_autocast_equals_the_eager_one():
    """bf16 autocast: the traced path multiplies in bf16 as the eager one does, and W casts dW back to the float32
    weight's dtype."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    eager, model = _TwoDeferringLinears(), _TwoDeferringLinears()
    model.load_state_dict(eager.state_dict())
    enable_deferred_weight_grads(model)
    x0 = torch.randn(2, 5, 8)
    compiled = torch.compile(model.forward, backend="aot_eager")
    grads = []
    for module, forward in ((eager, eager), (model, compiled)):
        x = x0.clone().requires_grad_()
        queue = WeightGradQueue()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(x)
        with collect_weight_grads(queue):
            out.float().square().sum().backward()
        assert len(queue) == 2 and all(g.dtype == torch.bfloat16 for _, _, g in queue._work)   # the matmuls' dtype
        queue.run()
        grads.append((x.grad, module.up.weight.grad, module.down.weight.grad))
    assert model.up.weight.grad.dtype == torch.float32
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)   # the same bf16 products, in the same order


def test_the_compiled_path_finds_the_parameter_behind_the_graphs_alias():
    marked, stray = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    marked.defer_weight_grad = False
    enable_deferred_weight_grads(marked)
    assert _owner(marked.weight) is marked.weight and _owner(marked.weight.detach()) is marked.weight
    marked.double()   # a cast (or a move) gives the weight new memory: the lookup finds it there too
    assert _owner(marked.weight.detach()) is marked.weight
    with pytest.raises(RuntimeError, match="enable_deferred_weight_grads"):
        _owner(stray.weight.detach())


# --- the executor ---------------------------------------------------------------------------------------


def _zero_bubble(pp, m, tp):
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp)).activate()
    chunks = build_chunks(state, None, tp=True)   # column/row-parallel linears (their weights are deferred)
    sync_shared_embedding_weights(chunks)
    deferred = []
    original = WeightGradQueue.run

    def run(queue):   # count the deferred weight gradients the W steps compute
        deferred.append(len(queue))
        original(queue)

    WeightGradQueue.run = run
    out = forward_backward(forward_step, microbatches(m), chunks, num_microbatches=m, tensor_shape=(S, B, H),
                           schedule="zb-h1", finalize_grads=lambda: allreduce_shared_embedding_grads(chunks))
    WeightGradQueue.run = original
    return out.loss, full_grads(chunks, state), deferred


@pytest.mark.parametrize("world, pp, m, tp", [(2, 2, 8, 1), (4, 4, 8, 1), (4, 4, 3, 1), (4, 2, 4, 2)],
                         ids=["pp2", "pp4", "pp4-fewer-microbatches", "tp2-pp2"])
def test_zero_bubble_executor_equals_single_stage(world, pp, m, tp):
    ref_loss, ref_grads = reference(m)
    results = run_on_ranks(_zero_bubble, world, pp, m, tp, timeout=60)
    seen = set()
    for rank, (loss, grads, deferred) in enumerate(results):
        if (rank // tp) % pp == pp - 1:
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        assert deferred == [2 * NUM_LAYERS // pp] * m   # one W per micro-batch: fc1 and fc2 of each block here
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-5, msg=f"rank {rank}: {name}")
        seen |= set(grads)
    assert seen == set(ref_grads)
