"""CUDA graphs: the pure buffer plan, the capture/replay bookkeeping on CPU (eager backend), and on a GPU
(marked ``gpu``) per-layer and full-iteration graphs that train a small GPT exactly like eager mode."""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.tensor_parallel import get_rng_tracker
from lightning_megatron.cuda_graphs import (CudaGraphError, CudaGraphShapeError, FullCudaGraphWrapper, GraphPiece,
                                            PartialCudaGraphs, layer_chunks, max_in_flight, normalize_scope,
                                            order_steps, static_buffer_plan)
from lightning_megatron.pipeline.schedules import schedule_order
from lightning_megatron.testing import run_on_ranks

VOCAB, SEQ, MB, HIDDEN = 64, 16, 2, 32


# -- pure: the order and the static-buffer plan ------------------------------------------------------
def test_order_steps_number_microbatches_per_chunk():
    steps = order_steps(schedule_order(8, 4, 0, 2))
    fwd = [(s.chunk, s.microbatch) for s in steps if s.is_forward]
    assert fwd[:10] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (0, 4), (0, 5)]
    bwd = [(s.chunk, s.microbatch) for s in steps if not s.is_forward]
    assert bwd[:2] == [(1, 0), (1, 1)] and sorted(bwd) == sorted(fwd)


@pytest.mark.parametrize("order, message", [([1, -2], "before its forward"), ([0], "entries are"),
                                            ([1, 1, -1], "without their backward"), ([], "empty")])
def test_order_steps_refuses_orders_that_cannot_run(order, message):
    with pytest.raises(ValueError, match=message):
        order_steps(order)


@pytest.mark.parametrize("pp, chunks", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_static_buffers_follow_forwards_in_flight_not_microbatches(pp, chunks):
    for rank in range(pp):
        counts = []
        for m in (8, 16, 32):
            order = schedule_order(m, pp, rank, chunks)
            plan = static_buffer_plan(order)
            assert plan.total_buffers == max_in_flight(order)
            counts.append(plan.total_buffers)
            live = {}   # buffer -> micro-batch using it: never two in flight on one buffer
            for step in order_steps(order):
                slot = plan.slot[(step.chunk, step.microbatch)]
                if step.is_forward:
                    assert slot not in live
                    live[slot] = (step.chunk, step.microbatch)
                else:
                    assert live.pop(slot) == (step.chunk, step.microbatch)
        # seed 003: (PP - rank - 1)·2 + (VPP - 1)·PP + 1 interleaved, PP - rank plain 1F1B; whatever M is
        expected = (pp - rank - 1) * 2 + (chunks - 1) * pp + 1 if chunks > 1 else pp - rank
        assert counts == [expected] * 3, (pp, chunks, rank, counts)
    assert static_buffer_plan(schedule_order(16, 1, 0)).total_buffers == 1   # no pipelining: F,B,F,B


def test_buffer_keys_separate_chunks_of_different_shapes():
    order = schedule_order(4, 2, 0, 2)
    shared = static_buffer_plan(order).total_buffers
    split = static_buffer_plan(order, keys=["a", "b"])
    assert split.total_buffers >= shared and set(split.num_buffers) == {"a", "b"}


def test_scope_validation_names_the_fix():
    assert normalize_scope(None) == {"layer"} and normalize_scope(["attn", "mlp"]) == {"attn", "mlp"}
    with pytest.raises(ValueError, match="not in"):
        normalize_scope("attention")
    with pytest.raises(ValueError, match="'layer' alone"):
        normalize_scope(["layer", "attn"])
    assert normalize_scope("block") == {"block"}
    with pytest.raises(ValueError, match="'block' alone"):
        normalize_scope(["block", "mlp"])


def test_full_wrapper_refuses_new_shapes_and_keeps_eager_grad_semantics():
    lin = torch.nn.Linear(4, 3)

    def step(x):
        loss = lin(x).square().mean()
        loss.backward()
        return loss.detach()

    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    wrapper = FullCudaGraphWrapper(step, params=lin.parameters(), warmup_steps=1, backend="eager")
    xs = [torch.randn(5, 4) for _ in range(4)]
    for i, x in enumerate(xs):
        if i % 2 == 0:
            lin.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        got = wrapper(x)           # call 2 captures, 3-4 replay; grads accumulate over pairs of calls
        want = ref(x).square().mean()
        want.backward()
        torch.testing.assert_close(got, want.detach())
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    assert wrapper.is_captured(training=True) and not wrapper.is_captured(training=False)
    with pytest.raises(CudaGraphShapeError, match=r"\[0\]\[0\] was tensor\[5, 4\].*now tensor\[6, 4\]"):
        wrapper(torch.randn(6, 4))
    with pytest.raises(CudaGraphError, match="params"):
        FullCudaGraphWrapper(step, warmup_steps=0, backend="eager")(xs[0])


def test_a_capture_that_touched_the_legacy_stream_names_compiled_layers():
    """The failure seen with compiled layers inside the whole-step graph gets the fix in its message; other capture
    failures do not."""
    lin = torch.nn.Linear(4, 3)
    calls = []

    def step(x, error):
        calls.append(1)
        if len(calls) > 1:   # the capture, after one eager warm-up call
            raise RuntimeError(error)
        lin(x).sum().backward()

    for error, hinted in (("CUDA error: operation would make the legacy stream depend on a capturing blocking "
                           "stream", True), ("CUDA error: operation not permitted when stream is capturing", False)):
        calls.clear()
        wrapper = FullCudaGraphWrapper(step, params=lin.parameters(), warmup_steps=1, backend="eager")
        wrapper(torch.randn(2, 4), error)
        with pytest.raises(CudaGraphError) as caught:
            wrapper(torch.randn(2, 4), error)
        assert ("compile_layers='auto'" in str(caught.value)) == hinted, str(caught.value)


# -- the graphable-layer protocol --------------------------------------------------------------------
class _Residual(torch.nn.Module):
    """A user's own layer, graphed whole through the protocol; ``scale`` is a host value baked into its graph."""

    def __init__(self, width, scale=1.0):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.scale = scale
        self.graphed = None

    def forward(self, x):
        return self.graphed(x) if self.graphed is not None else self._forward(x)

    def _forward(self, x):
        return x + self.scale * torch.tanh(self.linear(x))

    def graph_pieces(self, scope):
        if scope != {"layer"}:
            raise ValueError("_Residual is graphed whole: use cuda_graph_scope='layer'.")
        return [GraphPiece("forward", self._forward, self._forward, [self], name="(residual)")]

    def set_graphed(self, entry, fn):
        previous, self.graphed = self.graphed, fn
        return previous

    def graph_constants(self):
        return {"scale": self.scale}


def _steps(graphs, layers, ref, xs, steps):
    """SGD steps of the graphed layers and an eager copy; their gradients must agree at every step."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (torch.nn.ModuleList(layers), torch.nn.ModuleList(ref))]
    for _ in range(steps):
        graphs.begin_step(schedule_order(len(xs), 1, 0))
        for stack in (layers, ref):
            for x in xs:     # F, B per micro-batch: the order schedule_order gives one stage
                h = x
                for layer in stack:
                    h = layer(h)
                h.square().mean().backward()
        for a, b in zip(layers, ref):
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_a_users_layer_implementing_the_protocol_is_graphed_and_trains_like_eager():
    import copy

    torch.manual_seed(0)
    layers = [_Residual(8) for _ in range(3)]
    ref = copy.deepcopy(layers)
    graphs = PartialCudaGraphs([layers], warmup_steps=1, backend="eager")
    assert all(layer.graphed is not None for layer in layers)   # the layers route their calls, nothing patched
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    _steps(graphs, layers, ref, xs, steps=4)
    assert graphs.captured and graphs.mode == "replay"
    stats = graphs.stats()
    assert stats["pieces"] == ["layer 0 (residual)", "layer 1 (residual)", "layer 2 (residual)"]
    assert stats["graphs"] == 2 * 3 * 2 and stats["static_input_buffers"] == 1   # chained: one input buffer
    graphs.begin_step(schedule_order(len(xs), 1, 0))
    with pytest.warns(UserWarning, match=r"layer 0 \(residual\): .*running it eagerly"):
        layers[0](torch.randn(5, 8, requires_grad=True))    # the graph's call saw the new shape
    for layer in ref:   # a baked constant changed: the step runs eagerly
        layer.scale = 0.5
    for layer in layers:
        layer.scale = 0.5
    with pytest.warns(UserWarning, match="a constant baked into the graphs changed"):
        _steps(graphs, layers, ref, xs, steps=1)
    assert graphs.mode == "eager"
    graphs.remove()
    assert all(layer.graphed is None for layer in layers)


def _hooks_and_grads(backend):
    """The replays deliver parameter gradients by hand (runner.py): each parameter's post-accumulate hooks once a
    backward; parameters shared by two graphed layers go through autograd (summed before one hook call); a tensor
    hook present at the capture runs once (inside the graph), one added later makes the steps run eagerly."""
    import copy

    device = "cuda" if backend == "cuda" else "cpu"
    calls = {}

    def count(stack):
        def hook(param):
            calls[(id(stack), id(param))] = calls.get((id(stack), id(param)), 0) + 1
        for layer in stack:
            for param in layer.parameters():
                if not param._post_accumulate_grad_hooks:
                    param.register_post_accumulate_grad_hook(hook)

    torch.manual_seed(0)
    xs = [torch.randn(4, 8, device=device, requires_grad=True) for _ in range(2)]
    layers = [_Residual(8).to(device) for _ in range(3)]
    layers[2].linear = layers[1].linear                   # shared by two graphed layers
    ref = copy.deepcopy(layers)
    for stack in (layers, ref):                           # present at the capture: inside the graph, run once
        stack[0].linear.weight.register_hook(lambda g: 2 * g)
        count(stack)
    graphs = PartialCudaGraphs([layers], warmup_steps=1, backend=backend)
    _steps(graphs, layers, ref, xs, steps=3)                 # warm-up, capture, replays; gradients as eager's
    assert graphs.mode == "replay"
    assert [s.runners[0].grads_by_hand for s in graphs.chunks[0]] == [True, False, False]
    assert sorted(calls.values()) == [6] * 8                 # 4 parameters a stack, 3 steps x 2 micro-batches
    for stack in (layers, ref):                              # added after the capture: the steps run eagerly
        stack[1].linear.bias.register_hook(lambda g: 3 * g)
    with pytest.warns(UserWarning, match=r"a tensor hook \(register_hook\) on a graphed parameter was added or "
                                         r"removed after the capture"):
        _steps(graphs, layers, ref, xs, steps=2)
    assert graphs.mode == "eager"
    graphs.remove()
    return True


def test_parameter_gradients_reach_hooks_and_grads_as_autograd_delivers_them():
    assert _hooks_and_grads("eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_parameter_gradients_reach_hooks_and_grads_as_autograd_delivers_them():
    assert _hooks_and_grads("cuda")


def test_a_shared_parameter_with_a_tensor_hook_is_refused_at_the_capture():
    """Autograd delivers a parameter two graphed pieces share (one hook call for the sum), and would run its tensor
    hook a second time after the captured backward ran it: refused, naming the fix."""
    layers = [_Residual(8) for _ in range(2)]
    layers[1].linear = layers[0].linear
    layers[0].linear.weight.register_hook(lambda g: 2 * g)
    graphs = PartialCudaGraphs([layers], warmup_steps=1, backend="eager")
    x = torch.randn(4, 8, requires_grad=True)
    graphs.begin_step(schedule_order(1, 1, 0))
    layers[1](layers[0](x)).sum().backward()
    with pytest.raises(CudaGraphError, match=r"layer 0 \(residual\) shares a parameter with another graphed piece "
                                             r"and its parameters have tensor hooks .*register_post_accumulate_grad_hook"):
        graphs.begin_step(schedule_order(1, 1, 0))


def test_layer_chunks_finds_a_users_container_by_graphable_layers():
    class Stack(torch.nn.Module):   # a user's own container: the method is all layer_chunks reads
        def __init__(self):
            super().__init__()
            self.body = torch.nn.ModuleList([_Residual(4), _Residual(4)])

        def graphable_layers(self):
            return self.body

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Stack())
    assert layer_chunks(model) == [list(model[1].body)]
    with pytest.raises(ValueError, match=r"found 2 containers of graphable layers .* in Sequential"):
        layer_chunks(torch.nn.Sequential(Stack(), Stack()))
    # "block" graphs the container whole: only one that speaks the graphable-layer protocol itself
    with pytest.raises(ValueError, match=r"cuda_graph_scope='block' .* Stack does not implement the graphable-layer "
                                         r"protocol \(graph_pieces, set_graphed, graph_constants missing\)"):
        layer_chunks(model, scope="block")


def _block_scope_checks():
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer import TransformerBlock, TransformerConfig

    ParallelState(ParallelLayout(1)).activate()
    block = TransformerBlock(TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"'block' graphs the container .* layer_chunks\(model, scope='block'\)"):
        PartialCudaGraphs([list(block.layers)], scope="block", backend="eager")
    assert layer_chunks(block, scope="block") == [[block]]
    graphs = PartialCudaGraphs(layer_chunks(block, scope="block"), scope="block", backend="eager")
    assert graphs.stats()["pieces"] == ["block"] and block.graphed_calls and not block.layers[0].graphed_calls
    graphs.remove()
    assert not block.graphed_calls
    return True


def test_block_scope_is_refused_by_a_layer_and_taken_by_its_block():
    assert run_on_ranks(_block_scope_checks, 1, timeout=120) == [True]


def test_before_capture_stats_are_empty_and_a_second_owner_is_refused():
    layers = [_Residual(4)]
    graphs = PartialCudaGraphs([layers], backend="eager")
    assert graphs.stats() == {"graphs": 0, "static_input_slots": [], "static_input_buffers": 0,
                              "max_in_flight": None, "pieces": ["layer 0 (residual)"]}
    with pytest.raises(CudaGraphError, match=r"_Residual.forward of layer 0 \(residual\) is already taken over"):
        PartialCudaGraphs([layers], backend="eager")
    assert layers[0].graphed is not None    # the first owner keeps the call
    graphs.remove()
    PartialCudaGraphs([layers], backend="eager").remove()


def test_a_layer_without_the_protocol_is_refused_naming_what_is_missing():
    class HalfDone(torch.nn.Linear):
        def set_graphed(self, entry, fn):
            return None

    with pytest.raises(CudaGraphError, match=r"layer 1 \(Linear\) cannot be graphed: it lacks graph_pieces, "
                                             r"set_graphed, graph_constants of the graphable-layer protocol"):
        PartialCudaGraphs([[_Residual(4), torch.nn.Linear(4, 4)]], backend="eager")
    with pytest.raises(CudaGraphError, match=r"HalfDone\) cannot be graphed: it lacks graph_pieces, graph_constants "):
        PartialCudaGraphs([[HalfDone(4, 4)]], backend="eager")
    with pytest.raises(ValueError, match="graphed whole"):     # the layer's own refusal of a scope
        PartialCudaGraphs([[_Residual(4)]], scope=["attn"], backend="eager")


# -- a small GPT trained eagerly and with graphs ---------------------------------------------------
def _moe_config(expert_backend="auto", spare=0):
    from lightning_megatron.moe import MoEConfig

    return MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=64, num_experts=4, topk=2, aux_loss_coeff=1e-2,
                     expert_backend=expert_backend, num_spare_experts_per_ep_rank=spare,
                     echo_tolerance=0.0)   # offload every imbalance: the tiny model's plans use slots


def _train(mode, *, pp=1, vp=None, steps=5, warmup=2, scope="layer", dropout=0.1, dtype=torch.float32,
           moe=False, num_mb=4, graph_backend="cuda", layers=4, expert_backend="auto", autocast=None, ep=1,
           spare=0):
    """Losses of ``steps`` SGD steps and the last step's gradients (this rank's parameters)."""
    from lightning_megatron.models import GPTModel
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.pipeline import VirtualChunks, forward_backward
    from lightning_megatron.tensor_parallel import model_parallel_seed
    from lightning_megatron.transformer import TransformerConfig

    world = dist.get_world_size()
    if graph_backend == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if graph_backend == "cuda" else torch.device("cpu")
    state = ParallelState(ParallelLayout(world, pp=pp, ep=ep), virtual_pipeline_size=vp).activate()
    model_parallel_seed(1234)
    cfg = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=dropout,
                            attention_dropout=dropout, params_dtype=dtype, moe_layer_freq=2,
                            moe=_moe_config(expert_backend, spare) if moe else None)
    model = VirtualChunks(lambda v: GPTModel(cfg, VOCAB, SEQ, vp_rank=v)).to(device)
    chunks = vp or 1
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (num_mb * MB, SEQ), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (num_mb * MB, SEQ), generator=gen).to(device)

    def forward_step(mb, _chunk, ctx):
        if ctx.is_last_stage:
            return model(mb[0], labels=mb[1]).mean()
        return model(mb[0])

    def run_step(ids, labels, forward_only=False):
        micro = [(ids[i * MB:(i + 1) * MB], labels[i * MB:(i + 1) * MB]) for i in range(num_mb)]
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = forward_backward(forward_step, micro, [model] * chunks, dtype=autocast or dtype,
                                   tensor_shape=(SEQ, MB, HIDDEN), pp_group=state.pp_group if pp > 1 else None,
                                   forward_only=forward_only)
        return out.loss

    def last_stage_value(loss):
        box = [None if loss is None else float(loss)]
        if pp > 1:
            dist.broadcast_object_list(box, src=state.ranks("pp")[-1], group=state.pp_group)
        return box[0]

    graphs = wrapper = None
    if mode == "partial":
        graphs = PartialCudaGraphs(layer_chunks(model, chunks, scope), scope=scope, warmup_steps=warmup,
                                   rng_tracker=get_rng_tracker(state), backend=graph_backend)
    elif mode == "full":
        wrapper = FullCudaGraphWrapper(run_step, params=model.parameters(), warmup_steps=warmup,
                                       rng_tracker=get_rng_tracker(state), backend=graph_backend)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if graphs is not None:
            graphs.begin_step(schedule_order(num_mb, pp, state.pp_rank, chunks))
        loss = wrapper(ids, labels) if wrapper is not None else run_step(ids, labels)
        losses.append(last_stage_value(loss))
        grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    model.eval()   # validation: eager under partial graphs, its own graph under the full wrapper
    for _ in range(warmup + 2):
        with torch.no_grad():
            loss = wrapper(ids, labels, forward_only=True, training=False) if wrapper is not None \
                else run_step(ids, labels, forward_only=True)
    losses.append(last_stage_value(loss))
    if wrapper is not None:
        assert wrapper.is_captured(training=True) and wrapper.is_captured(training=False)
    stats = dict(graphs.stats()) if graphs is not None else {}
    if graphs is not None:
        assert graphs.captured
        graphs.remove()
    if spare:   # the last forward's ECHO plan: how many spare slots hold an expert copy
        from lightning_megatron.moe import MoELayer

        stats["echo_slots_used"] = sum(int((m.dispatcher.meta.spare_homes >= 0).sum())
                                       for m in model.modules() if isinstance(m, MoELayer))
    return losses, grads, stats


def _modes(runs, **common):
    """Run the eager reference and each (mode, options) in one process; results by name."""
    out = {"eager": _train("eager", **common)}
    for name, mode, options in runs:
        out[name] = _train(mode, **{**common, **options})
    return out


def _assert_same(results, loss_tol, grad_tol):
    ref_losses, ref_grads, _ = results.pop("eager")
    for name, (losses, grads, _) in results.items():
        assert losses == pytest.approx(ref_losses, rel=loss_tol, abs=loss_tol), name
        assert grads.keys() == ref_grads.keys(), name
        for key, grad in ref_grads.items():
            torch.testing.assert_close(grads[key], grad, atol=grad_tol, rtol=grad_tol,
                                       msg=lambda m: f"{name} {key}: {m}")


DENSE_RUNS = [("partial", "partial", {}), ("partial block", "partial", {"scope": "block"}),
              ("partial attn+mlp", "partial", {"scope": ["attn", "mlp"]}),
              ("partial attn", "partial", {"scope": "attn"}), ("full", "full", {})]


def test_graph_bookkeeping_trains_like_eager_on_cpu():
    """The eager backend runs the same capture order, buffer plan, chaining and replay routing."""
    results = run_on_ranks(_modes, 1, DENSE_RUNS, graph_backend="eager", timeout=300)[0]
    # "block": one forward and one backward graph a micro-batch for the chunk's 4 layers; "layer": one per layer
    assert results["partial block"][2]["pieces"] == ["block"] and results["partial block"][2]["graphs"] == 2 * 4
    assert results["partial"][2]["pieces"] == [f"layer {i}" for i in range(4)] and results["partial"][2]["graphs"] == 32
    _assert_same(results, 1e-6, 1e-6)


def test_partial_graphs_capture_under_the_autocast_the_layers_ran_under_on_cpu():
    """Mixed precision: the layers ran under autocast during warm-up, so their graphs are captured under
    it (without the cast cache); losses and gradients equal eager autocast training."""
    runs = [("partial", "partial", {}), ("full", "full", {})]
    results = run_on_ranks(_modes, 1, runs, graph_backend="eager", autocast=torch.bfloat16, steps=4, timeout=300)[0]
    _assert_same(results, 1e-6, 1e-6)


def test_graph_bookkeeping_with_pipeline_and_virtual_stages_on_cpu():
    """PP=2 with two chunks per rank: several forwards in flight share static buffers by the plan
    (a buffer reused too early would fail autograd's version check in the eager backend)."""
    runs = [("partial", "partial", {}), ("partial block", "partial", {"scope": "block"}),
            ("partial attn", "partial", {"scope": "attn"}), ("full", "full", {})]
    per_rank = run_on_ranks(_modes, 2, runs, graph_backend="eager", pp=2, vp=2, steps=4, timeout=300)
    for results in per_rank:
        _assert_same(results, 1e-6, 1e-6)


def test_moe_partial_scopes_train_like_eager_on_cpu():
    runs = [("router", "partial", {"scope": ["attn", "moe_router"]}),
            ("preprocess", "partial", {"scope": ["attn", "moe_router", "moe_preprocess"]}),
            ("preprocess only", "partial", {"scope": ["moe_preprocess", "mlp"]})]
    results = run_on_ranks(_modes, 1, runs, graph_backend="eager", moe=True, steps=4, timeout=300)[0]
    _assert_same(results, 1e-6, 1e-6)


def test_moe_partial_scopes_carry_the_echo_plan_on_cpu():
    """EP=2 with a spare slot per rank: the offloading plan (rerouted map, probs and each slot's home
    expert) leaves the router/preprocess graphs as outputs and the eager rest uses the replayed plan."""
    runs = [("router", "partial", {"scope": ["attn", "moe_router"]}),
            ("preprocess", "partial", {"scope": ["attn", "moe_router", "moe_preprocess"]})]
    per_rank = run_on_ranks(_modes, 2, runs, graph_backend="eager", moe=True, ep=2, spare=1, steps=4, timeout=300)
    for results in per_rank:
        assert all(stats["echo_slots_used"] > 0 for _, _, stats in results.values()), "nothing was offloaded"
        _assert_same(results, 1e-6, 1e-6)


# -- on a GPU ------------------------------------------------------------------------------------------
def _on_gpu(fn, *args, **kwargs):
    return run_on_ranks(fn, 1, *args, backend="nccl", timeout=300, **kwargs)[0]


@pytest.mark.gpu
def test_gpu_partial_and_full_graphs_train_like_eager_fp32_dropout():
    _assert_same(_on_gpu(_modes, DENSE_RUNS, graph_backend="cuda", steps=6), 1e-5, 1e-4)


@pytest.mark.gpu
def test_gpu_graphs_train_like_eager_bf16():
    runs = [("partial", "partial", {}), ("full", "full", {})]
    _assert_same(_on_gpu(_modes, runs, graph_backend="cuda", dtype=torch.bfloat16, dropout=0.0), 1e-3, 2e-2)


@pytest.mark.gpu
def test_gpu_moe_partial_capture_trains_like_eager():
    runs = [("router", "partial", {"scope": ["attn", "moe_router"]}),
            ("preprocess", "partial", {"scope": ["attn", "moe_router", "moe_preprocess"]})]
    _assert_same(_on_gpu(_modes, runs, graph_backend="cuda", moe=True), 1e-5, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_moe_partial_capture_with_echo_over_two_gpus_trains_like_eager():
    """EP=2 over NCCL with an ECHO spare slot per rank: the router (+ plan) and preprocess graphs replay
    the offloading plan, the eager rest dispatches by it."""
    runs = [("router", "partial", {"scope": ["attn", "moe_router"]}),
            ("preprocess", "partial", {"scope": ["attn", "moe_router", "moe_preprocess"]})]
    per_rank = run_on_ranks(_modes, 2, runs, graph_backend="cuda", moe=True, ep=2, spare=1, backend="nccl",
                            timeout=300)
    for results in per_rank:
        assert all(stats["echo_slots_used"] > 0 for _, _, stats in results.values()), "nothing was offloaded"
        _assert_same(results, 1e-5, 1e-4)


def _capture_error(**options):
    try:
        _train("partial", graph_backend="cuda", steps=3, **options)
    except CudaGraphError as exc:
        return str(exc)
    return "no error"


@pytest.mark.gpu
def test_gpu_capturing_a_host_sync_names_the_layer_and_the_fix():
    """A whole MoE layer whose experts read their token counts on the host cannot be captured."""
    message = _on_gpu(_capture_error, moe=True, scope="layer", expert_backend="loop")
    print(message[:400])
    assert "capturing the forward of layer 0" in message and "moe_router" in message


def _graph_memory(num_mb):
    """Device memory the partial graphs hold after capture (PP=1), and their stats."""
    from lightning_megatron.models import GPTModel
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.pipeline import forward_backward
    from lightning_megatron.transformer import TransformerConfig

    state = ParallelState(ParallelLayout(1)).activate()
    cfg = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0)
    model = GPTModel(cfg, 512, 128).cuda()
    ids = torch.randint(0, 512, (num_mb * 4, 128), device="cuda")
    micro = [(ids[i * 4:(i + 1) * 4],) * 2 for i in range(num_mb)]
    graphs = PartialCudaGraphs(layer_chunks(model), warmup_steps=1, rng_tracker=get_rng_tracker(state))

    def step():
        forward_backward(lambda mb, chunk, ctx: chunk(mb[0], labels=mb[1]).mean(), micro, model)

    graphs.begin_step(schedule_order(num_mb, 1, 0))
    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graphs.begin_step(schedule_order(num_mb, 1, 0))   # captures
    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - before, graphs.stats()


@pytest.mark.gpu
def test_gpu_partial_graph_memory_is_flat_in_the_microbatch_count():
    used = {m: _on_gpu(_graph_memory, m) for m in (4, 16)}
    for m, (nbytes, stats) in used.items():
        print(f"partial graphs, PP=1, {m} micro-batches: {nbytes / 2**20:.1f} MiB held, {stats['graphs']} graphs, "
              f"static input slots {stats['static_input_slots']}")
        assert stats["static_input_slots"] == [1]
    assert used[16][0] <= 1.25 * used[4][0] + 4 * 2**20


def _shape_change():
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    ParallelState(ParallelLayout(1)).activate()
    lin = torch.nn.Linear(8, 8).cuda()

    def step(x):
        lin(x).sum().backward()

    wrapper = FullCudaGraphWrapper(step, params=lin.parameters(), warmup_steps=1)
    for _ in range(3):
        wrapper(torch.randn(4, 8, device="cuda"))
    try:
        wrapper(torch.randn(5, 8, device="cuda"))
    except CudaGraphShapeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.gpu
def test_gpu_full_graph_refuses_a_new_batch_shape():
    assert "tensor[4, 8]" in _on_gpu(_shape_change)
