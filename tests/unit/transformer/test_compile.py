"""Compiled transformer layers (``transformer/compile.py``): the same numbers as eager, the same module tree.

The layer matrix over every layout runs through the Trainer in test_strategy_updates.py (``*-compiled``, traced
with ``aot_eager``); here inductor itself, at tensor parallel 2 with dropout on: the collectives and the two
kinds of dropout masks (same on every tp rank outside the tensor-parallel regions, different inside) are
traced into one graph and draw what eager draws.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer.compile import (apply_compile_layers, check_compile_layers, compile_layers,
                                                   compiled_bodies, resolve_compile_layers, uncompile_layer)


@pytest.mark.parametrize("bad", ["yes", 1, 0, ["inductor"], {"backnd": "inductor"}])
def test_bad_compile_layers_named(bad):
    with pytest.raises(ValueError, match="compile_layers"):
        check_compile_layers(bad)


def test_auto_compiles_where_it_measured_faster_and_explicit_compiles_everywhere():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_compile_layers("auto", cpu) is None
    assert resolve_compile_layers(None, cuda) == {}
    assert resolve_compile_layers("auto", cuda, cp=2) is None
    assert resolve_compile_layers(True, cpu, cp=2) == {}   # the CPU runs them (tests)
    # GPUs confirmed both equal to eager (tests/gpu/test_compiled_layers_gpu.py): asked for, they compile
    assert resolve_compile_layers(True, cuda, cp=2) == {}
    assert resolve_compile_layers({"mode": "max-autotune-no-cudagraphs"}, cuda, cp=2) == \
        {"mode": "max-autotune-no-cudagraphs"}
    assert resolve_compile_layers(False, cuda) is None
    assert resolve_compile_layers({"backend": "aot_eager"}, cpu) == {"backend": "aot_eager"}


def _tiny_gpt(**overrides):
    from lightning_megatron.models import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    cfg = dict(num_layers=3, hidden_size=16, num_attention_heads=4, num_query_groups=2, activation="swiglu",
               normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
               hidden_dropout=0.0, attention_dropout=0.0)
    cfg.update(overrides)
    return GPTModel(TransformerConfig(**cfg), 64, 8)


def _state_dict_and_modules():
    from lightning_megatron.parallel import ParallelLayout, ParallelState

    ParallelState(ParallelLayout(1)).activate()
    model = _tiny_gpt()
    keys, modules = list(model.state_dict()), [name for name, _ in model.named_modules()]
    assert apply_compile_layers(model, "auto", torch.device("cpu")) == 0   # auto: eager on the CPU
    assert compile_layers(model, backend="eager") == 3
    assert list(model.state_dict()) == keys                 # no _orig_mod: checkpoints load either way
    assert [name for name, _ in model.named_modules()] == modules
    layer = model.decoder.layers[0]
    assert compiled_bodies(layer) == ["_forward", "_attention_block", "_mlp_block"]
    first = layer._forward
    assert compile_layers(model, backend="eager") == 3 and layer._forward is first   # twice: compiled once
    uncompile_layer(layer)
    assert compiled_bodies(layer) == [] and layer._forward.__func__ is type(layer)._forward
    return True


def _auto_decides_at_the_first_call():
    import lightning_megatron.transformer.compile as compile_module
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from lightning_megatron.adapter.layer_setup import prepare_layers
    from lightning_megatron.transformer.layer import TransformerLayer

    ParallelState(ParallelLayout(1)).activate()
    cuda = torch.device("cuda", 0)   # nothing runs on it: the bodies decide on the CPU tensors they are given
    ids = torch.randint(0, 64, (2, 8))   # 16 tokens of hidden 16: 16 * 16**2 = 4096 "work"
    torch.manual_seed(0)
    reference = _tiny_gpt()
    expected = reference(ids)

    def run(min_work, cp=1, cuda_graph=None):
        compile_module.AUTO_MIN_LAYER_WORK = min_work
        model = _tiny_gpt()
        model.load_state_dict(reference.state_dict())
        count, fused = prepare_layers(model, "auto", cuda, cp, cuda_graph, report=said.append)
        out = model(ids)
        torch.testing.assert_close(out, expected)
        layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
        linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        return (count, fused, sorted({tuple(compiled_bodies(layer)) for layer in layers}),
                sum(linear.accumulate_weight_grads for linear in linears))

    # "auto" resolves to {} (inductor) on CUDA; the CPU test compiles with the eager backend instead
    compile_module.resolve_compile_layers = lambda setting, device, cp=1: None if cp > 1 else {"backend": "eager"}
    said = []
    runs = [run(4097),                    # just short of the threshold: eager, the fusion turned back off
            run(4096),                    # enough work: compiled, the fusion kept
            run(1, cp=1, cuda_graph="full"),   # never inside a full-iteration graph
            run(1, cp=2)]
    return runs, said


def test_auto_compiles_the_layers_whose_first_call_carries_enough_work():
    from lightning_megatron.transformer.compile import AUTO_MIN_LAYER_WORK, auto_compiles

    assert not auto_compiles(512, 768) and auto_compiles(8192, 896)   # BERT-base measured slower, the chat shape
    assert auto_compiles(8192, 2048) and AUTO_MIN_LAYER_WORK == 2 ** 30
    bodies = ("_forward", "_attention_block", "_mlp_block")
    runs, said = run_on_ranks(_auto_decides_at_the_first_call, 1, timeout=180)[0]
    assert runs == [(3, 15, [()], 0), (3, 15, [bodies], 15), (0, 0, [()], 0), (0, 0, [()], 0)]
    assert len(said) == 2 and "16 tokens of width 16 a call" in said[0]   # one line a model, from its first layer
    assert "eager (host-bound" in said[0] and said[1].endswith("-> layers compiled"), said


def test_compiled_model_keeps_its_state_dict_and_modules():
    assert run_on_ranks(_state_dict_and_modules, 1, timeout=120) == [True]


def _compiled_vs_eager(sequence_parallel):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.random import model_parallel_seed

    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=2)).activate()
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = _tiny_gpt(sequence_parallel=sequence_parallel, hidden_dropout=0.2, attention_dropout=0.2)
        if compiled:
            compile_layers(model)
        model_parallel_seed(7)   # the same masks to draw, both runs
        loss = model(ids, labels=labels).mean()
        loss.backward()
        out[compiled] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                         dict(counters["stats"]), dict(counters["graph_break"]))
    state.destroy()
    return out


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_inductor_layers_equal_eager_with_dropout_under_tensor_parallel(sequence_parallel):
    for out in run_on_ranks(_compiled_vs_eager, 2, sequence_parallel, timeout=400):
        eager, compiled = out[False], out[True]
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
        for name, grad in eager[1].items():
            torch.testing.assert_close(compiled[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert compiled[2]["unique_graphs"] >= 1
        if sequence_parallel:   # (without it, dropout's tensor-parallel RNG fork breaks the graph too)
            # every graph break is a tensor-parallel collective left eager (tensor_parallel/mappings.py), and the
            # three layers share their graphs (the pieces between one layer's collectives: at most 10)
            assert compiled[3] and all("_eager_apply" in reason or "column_parallel_linear" in reason
                                       for reason in compiled[3]), compiled[3]
            assert compiled[2]["unique_graphs"] <= 10, compiled[2]


def _fit_and_list_compiled(setting):
    import lightning as L
    from torch.utils.data import DataLoader

    from helpers.strategy_utils import TinyGPT, TokenData
    from lightning_megatron import MegatronStrategy
    from lightning_megatron.transformer.layer import TransformerLayer

    module = TinyGPT(layers=2)
    kwargs = {} if setting == "default" else dict(compile_layers=setting)
    trainer = L.Trainer(strategy=MegatronStrategy(**kwargs), accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TokenData(n=8), batch_size=4))
    return [compiled_bodies(m) for m in module.modules() if isinstance(m, TransformerLayer)]


@pytest.mark.parametrize("setting,compiled", [("default", False), (False, False), ({"backend": "eager"}, True)])
def test_strategy_compiles_the_layers_it_is_asked_to(setting, compiled):
    bodies = run_on_ranks(_fit_and_list_compiled, 1, setting, timeout=120)[0]
    assert len(bodies) == 2
    assert all(b == (["_forward", "_attention_block", "_mlp_block"] if compiled else []) for b in bodies), bodies


def test_strategy_refuses_a_bad_compile_layers():
    from lightning_megatron import MegatronStrategy

    with pytest.raises(ValueError, match="compile_layers='always'"):
        MegatronStrategy(compile_layers="always")


def _context_parallel_attention_under_compile():
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightning_megatron.context_parallel import split_for_context_parallel
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.tensor_parallel.random import model_parallel_seed

    state = ParallelState(ParallelLayout(dist.get_world_size(), cp=2)).activate()
    traced = []

    def recording_backend(gm, example_inputs):   # dynamo's graphs, run as they are
        traced.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=gen),
             "labels": torch.randint(0, 64, (2, 8), generator=gen)}
    local = split_for_context_parallel(batch, 2, state.cp_rank)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = _tiny_gpt(attention_dropout=0.2)
        if compiled:
            compile_layers(model, backend=recording_backend)
        model_parallel_seed(7)
        loss = model(local["input_ids"], labels=local["labels"]).mean()
        loss.backward()
        out[compiled] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    state.destroy()
    return out, traced, list(counters["graph_break"])


def test_context_parallel_attention_runs_eagerly_inside_compiled_layers():
    """Traced (its dropout stream's fork inside the compiled attention), the cp attention left eager's gradients
    on GPUs (tests/gpu/test_compiled_layouts_gpu.py); the CPU matched either way, so here: it is a graph break."""
    for out, traced, breaks in run_on_ranks(_context_parallel_attention_under_compile, 2, timeout=400):
        assert traced, "nothing was compiled"
        assert not [g for g in traced if any("scaled_dot_product" in target for target in g)], traced
        assert any("context_parallel_self_attention" in reason for reason in breaks), breaks
        (eager_loss, eager_grads), (loss, grads) = out[False], out[True]
        torch.testing.assert_close(loss, eager_loss)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=lambda m: f"{name}: {m}")


def _graphs_per_epoch(micro_batch_size):
    """Dynamo's compiled graphs after each epoch of a Trainer run whose last training batch is ragged (10 samples in
    batches of 4) and whose validation runs other batch sizes (5 samples in batches of 3)."""
    import lightning as L
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from helpers.strategy_utils import TinyGPT, TokenData
    from lightning_megatron import MegatronStrategy

    class Count(L.Callback):
        def __init__(self):
            self.graphs = []

        def on_validation_epoch_end(self, trainer, module):
            if not trainer.sanity_checking:
                self.graphs.append(counters["stats"]["unique_graphs"])

    torch._dynamo.reset()
    counters.clear()
    count = Count()
    module = TinyGPT(layers=2, position_embedding_type="rope", dropout=0.1)
    strategy = MegatronStrategy(compile_layers={"backend": "eager"}, micro_batch_size=micro_batch_size)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[count])
    trainer.fit(module, DataLoader(TokenData(n=10), batch_size=4), DataLoader(TokenData(n=5, seed=1), batch_size=3))
    return count.graphs, dict(counters["stats"])


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_compiled_layers_stop_compiling_after_the_first_epoch(micro_batch_size):
    """What recompiles is bounded (compile.py): new batch shapes (the ragged last batch, validation's sizes) and
    evaluation's no-grad graphs in the first epoch, then nothing: a guard on something that changes per step (a
    step counter, an RNG offset, a Python int of the batch) would add graphs every epoch."""
    graphs, stats = run_on_ranks(_graphs_per_epoch, 1, micro_batch_size, timeout=300)[0]
    assert len(graphs) == 4, graphs
    assert graphs[0] == graphs[-1], (graphs, stats)    # epochs 2-4 compiled nothing new
    assert 0 < graphs[0] <= 14, (graphs, stats)        # 13 and 8 graphs (this CPU): per body train/eval, static/dynamic
