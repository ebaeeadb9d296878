"""The fused, chunked cross-entropy (``tensor_parallel.fused_cross_entropy``) equals the unfused path:
``vocab_parallel_cross_entropy(F.linear(hidden, weight, bias), ...)`` behind the same tp mappings, in the
loss and in the gradients of hidden, weight and bias, at tp 1/2/4 (a tp-4 shard that holds only padding
included), with label smoothing, ignored tokens, chunks that do not divide the tokens; and a GPTModel with
``cross_entropy_chunk_size`` trains on the same loss and gradients as without."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelLayout, ParallelState
from lightning_megatron.tensor_parallel import (
    allreduce_sequence_parallel_grads, copy_to_tensor_parallel_region, vocab_parallel_cross_entropy,
)
from lightning_megatron.tensor_parallel.fused_cross_entropy import linear_cross_entropy, parallel_linear_cross_entropy
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer import TransformerConfig
from helpers.tp_utils import tp_state

S, B, H = 7, 3, 12                 # 21 tokens
VOCAB, PADDED = 13, 16             # tp4: shards of 4 rows, the last one only padding
TIGHT = dict(atol=2e-6, rtol=1e-5)


def _inputs(state, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=gen)
    weight = torch.randn(PADDED, H, generator=gen) * 0.5
    bias = torch.randn(PADDED, generator=gen) * 0.1
    target = torch.randint(0, VOCAB, (S, B), generator=gen)
    target[0, :2] = -100            # ignored tokens
    target[1, 0] = VOCAB - 1        # the last real column
    weights = torch.rand(S, B, generator=gen)   # a per-token output gradient
    rows = slice(state.tp_rank * PADDED // state.tp_size, (state.tp_rank + 1) * PADDED // state.tp_size)
    return hidden.to(dtype), weight[rows].to(dtype).contiguous(), bias[rows].to(dtype).contiguous(), target, weights


def _run(fused, hidden, weight, bias, target, weights, **kwargs):
    """``fused``: ``parallel_linear_cross_entropy`` (``chunk_size=None``: the logits whole, their gradient
    made in the forward); else the unfused path (``chunk_size`` ignored)."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    bias = bias.clone().requires_grad_() if bias is not None else None
    if fused:
        loss = parallel_linear_cross_entropy(hidden, weight, target, False, bias=bias, **kwargs)
    else:
        kwargs.pop("chunk_size")
        cap = kwargs.pop("logit_softcapping", None)
        logits = F.linear(copy_to_tensor_parallel_region(hidden), weight, bias)
        if cap is not None:   # as GPTModel caps the unfused logits
            logits = torch.tanh(logits / cap) * cap
        loss = vocab_parallel_cross_entropy(logits, target, **kwargs)
    (loss * weights).sum().backward()
    return loss.detach(), hidden.grad, weight.grad, bias.grad if bias is not None else None


def _fused_equals_unfused():
    state = tp_state()
    hidden, weight, bias, target, weights = _inputs(state)
    cases = 0
    for smoothing in (0.0, 0.1):
        for vocab in (VOCAB, PADDED):
            for chunk in (1, 5, 21, 64, None):
                for b in (None, bias):
                    kwargs = dict(label_smoothing=smoothing, vocab_size=vocab)
                    ref = _run(False, hidden, weight, b, target, weights, chunk_size=chunk, **kwargs)
                    out = _run(True, hidden, weight, b, target, weights, chunk_size=chunk, **kwargs)
                    for name, o, r in zip(("loss", "hidden", "weight", "bias"), out, ref):
                        if r is not None:
                            torch.testing.assert_close(o, r, **TIGHT, msg=lambda m: f"{name} {kwargs} {chunk}: {m}")
                    assert torch.all(out[0][0, :2] == 0) and torch.all(out[1][0, :2] == 0)
                    cases += 1
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_unfused(world):
    assert run_on_ranks(_fused_equals_unfused, world, timeout=120) == [40] * world


def _capped_equals_unfused():
    state = tp_state()
    hidden, weight, bias, target, weights = _inputs(state)
    for chunk in (5, None):
        for smoothing in (0.0, 0.1):
            kwargs = dict(label_smoothing=smoothing, vocab_size=VOCAB, logit_softcapping=1.5)
            ref = _run(False, hidden, weight, bias, target, weights, chunk_size=chunk, **kwargs)
            out = _run(True, hidden, weight, bias, target, weights, chunk_size=chunk, **kwargs)
            uncapped = _run(True, hidden, weight, bias, target, weights, chunk_size=chunk,
                            **dict(kwargs, logit_softcapping=None))
            for name, o, r, u in zip(("loss", "hidden", "weight", "bias"), out, ref, uncapped):
                torch.testing.assert_close(o, r, **TIGHT, msg=lambda m: f"{name} {kwargs} {chunk}: {m}")
                assert (o - u).abs().max() > 1e-2, name   # the cap of 1.5 bends logits of order 1: it shows


@pytest.mark.parametrize("world", [1, 2])
def test_soft_capped_logits_match_unfused(world):
    """Gemma 2's ``final_logit_softcapping``: the fused loss of ``c · tanh(logits / c)`` and its gradients."""
    run_on_ranks(_capped_equals_unfused, world, timeout=120)


def _low_precision(autocast):
    state = tp_state()
    dtype = torch.float32 if autocast else torch.bfloat16
    hidden, weight, bias, target, weights = _inputs(state, dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = _run(False, hidden, weight, None, target, weights, chunk_size=None, label_smoothing=0.1,
                   vocab_size=VOCAB)
        outs = [_run(True, hidden, weight, None, target, weights, chunk_size=chunk, label_smoothing=0.1,
                     vocab_size=VOCAB) for chunk in (4, None)]
    for out in outs:
        for o, r in zip(out[:3], ref[:3]):
            assert o.dtype == r.dtype
            torch.testing.assert_close(o, r, atol=1e-2, rtol=1e-2)
    return outs[1][0].dtype, outs[1][1].dtype, outs[1][2].dtype


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_low_precision_matches_unfused(autocast):
    dtype = torch.float32 if autocast else torch.bfloat16
    assert run_on_ranks(_low_precision, 2, autocast, timeout=60) == [(torch.float32, dtype, dtype)] * 2


def _gpt_grads(sequence_parallel, tie, label_smoothing, cap=None):
    state = ParallelState(ParallelLayout(dist.get_world_size(), tp=dist.get_world_size())).activate()
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, sequence_parallel=sequence_parallel, final_logit_softcapping=cap,
                            init_method_std=0.2 if cap else 0.02)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=gen)
    labels = torch.randint(0, 100, (2, 8), generator=gen)
    labels[1, 5:] = -100
    results = []
    # unfused (on the CPU also the default), chunked, whole logits with the gradient made in the forward
    for chunk, fused in ((None, False), (5, None), (None, True)):
        model = GPTModel(cfg, 100, max_sequence_length=8, tie_word_embeddings=tie, label_smoothing=label_smoothing,
                         cross_entropy_chunk_size=chunk, fused_cross_entropy=fused)
        loss = model(ids, labels=labels)
        (loss * (labels != -100)).sum().div(13).backward()
        allreduce_sequence_parallel_grads(model.parameters())
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads) = results[0]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, ref_loss, **TIGHT)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="fused_cross_entropy=False"):
        GPTModel(cfg, 100, max_sequence_length=8, cross_entropy_chunk_size=5, fused_cross_entropy=False)
    return sorted(grads)


@pytest.mark.parametrize("sequence_parallel,tie,label_smoothing,cap",
                         [(True, True, 0.1, None), (False, False, 0.0, None), (True, False, 0.0, 0.5)],
                         ids=["sp-tied-smoothing", "untied", "sp-soft-capped"])
def test_gpt_model_fused_loss_and_grads_equal_unfused(sequence_parallel, tie, label_smoothing, cap):
    names = run_on_ranks(_gpt_grads, 2, sequence_parallel, tie, label_smoothing, cap, timeout=120)[0]
    assert ("output_weight" in names) != tie and "decoder.final_norm.weight" in names


def _bad_chunk_sizes():
    tp_state()
    errors = []
    for chunk in (0, -3, 2.5, True):
        try:
            linear_cross_entropy(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long),
                                 chunk_size=chunk)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
        try:
            GPTModel(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2), 16, 4,
                     cross_entropy_chunk_size=chunk)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_bad_chunk_sizes_are_named():
    errors = run_on_ranks(_bad_chunk_sizes, 1, timeout=60)[0]
    assert all(e and "chunk_size must be a positive" in e for e in errors[::2]), errors
    assert all(e and "GPTModel cross_entropy_chunk_size must be a positive" in e for e in errors[1::2]), errors


def _recipes_pass_it_on():
    from lightning_megatron.recipes.pretrain import GPTPretraining, LlamaPretraining

    ParallelState(ParallelLayout(1)).activate()
    sizes = []
    for module in (GPTPretraining(num_layers=1, cross_entropy_chunk_size=64),
                   LlamaPretraining(num_layers=1, cross_entropy_chunk_size=64), GPTPretraining(num_layers=1)):
        module.configure_model()
        sizes.append(module.model.current.cross_entropy_chunk_size)
    return sizes


def test_pretraining_recipes_take_the_chunk_size():
    assert run_on_ranks(_recipes_pass_it_on, 1, timeout=60)[0] == [64, 64, None]


def _relative_error(x, ref):
    return float((x.float() - ref).norm() / ref.norm())


def _gpu_bf16():
    """bf16 on CUDA, the Triton passes and the torch passes: each result's error against a float32 computation
    on the same inputs, and the extra memory each path allocates."""
    from lightning_megatron.tensor_parallel.fused_cross_entropy import kernels_enabled, triton

    ParallelState(ParallelLayout(1)).activate()
    torch.manual_seed(0)
    n, h, vocab = 4096, 1024, 50304
    hidden = torch.randn(n, 1, h, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(vocab, h, device="cuda") * 0.05).to(torch.bfloat16)
    target = torch.randint(0, vocab - 5, (n, 1), device="cuda")
    target[:7] = -100
    weights = torch.rand(n, 1, device="cuda")
    kwargs = dict(label_smoothing=0.1, vocab_size=vocab - 5)
    exact = _run(False, hidden.float(), weight.float(), None, target, weights, chunk_size=None, **kwargs)
    errors, peaks = {}, {}
    for name, fused, kernels, chunk in (("unfused", False, False, None), ("torch", True, False, 1024),
                                        ("triton", True, True, 1024), ("triton-whole", True, True, None)):
        with kernels_enabled(kernels):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = _run(fused, hidden, weight, None, target, weights, chunk_size=chunk, **kwargs)
            torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        errors[name] = [_relative_error(x, e) for x, e in zip(out[:3], exact[:3])]
        del out
    return errors, peaks, triton is not None


@pytest.mark.gpu
def test_gpu_bf16_fused_matches_unfused_in_less_memory():
    errors, peaks, have_triton = run_on_ranks(_gpu_bf16, 1, backend="nccl", timeout=300)[0]
    for name in errors:
        print(f"{name:8s} relative error vs float32 (loss, grad hidden, grad weight): "
              + ", ".join(f"{e:.2e}" for e in errors[name]) + f"; extra peak memory {peaks[name] / 2**20:.0f} MiB")
    assert have_triton, "Triton should be installed on the GPU machine"
    for name in ("torch", "triton", "triton-whole"):
        for what, err, ref in zip(("loss", "grad hidden", "grad weight"), errors[name], errors["unfused"]):
            assert err < 1e-2 and err <= 2 * ref + 1e-4, (name, what, err, ref)
        assert peaks[name] < peaks["unfused"] / (2 if name != "triton-whole" else 1.5)
    assert peaks["triton"] <= peaks["torch"]
