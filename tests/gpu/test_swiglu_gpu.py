"""On a GPU: the SwiGLU/GeGLU Triton kernels (``ops/swiglu.py``) give the torch expression's output and input
gradient, evaluated in float64 and rounded once to the dtype (float32: to about an ulp; bf16: to an ulp), for
widths that are not a multiple of the kernels' block, 3-D and non-contiguous inputs and output gradients; and
compiled, as one graph that launches them, the same numbers.

The reference is float64 because torch's own float32 GeGLU backward loses digits (its ``1 - tanh²`` cancels where
``|tanh|`` nears 1, ~5e-5 absolute off at gradients ~10); the kernels write it through σ, without cancellation.
"""

import pytest
import torch

from helpers.gated_activations import FUNCTIONS, forward_backward, inputs, reference
from lightning_megatron.ops import swiglu as gated

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gated.triton is None, reason="the kernels need Triton")]

KERNELS = {"swiglu": gated.kernel_swiglu, "geglu": gated.kernel_geglu}
DTYPES = [torch.float32, torch.bfloat16]
# F = 14336 (Llama-3-8B: 14 full blocks), 1000 and 3 (one partial block), 2500 (full blocks, then a partial one)
SHAPES = [(64, 2 * 14336), (33, 2 * 1000), (5, 2 * 3), (17, 2 * 2500), (9, 4, 2 * 1000)]


def _tolerance(dtype):
    # float32: the kernels' exp and division are a few ulps off; bf16: one rounding of nearly the same value, at
    # most an ulp (2^-8 relative) apart
    return {"rtol": 1e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}


def _check(out, dh, h, grad, activation, dtype):
    ref_out, ref_dh = forward_backward(reference(activation), h, grad, dtype)
    assert out.dtype == dtype and dh.dtype == dtype
    assert out.shape == ref_out.shape and dh.shape == h.shape
    torch.testing.assert_close(out, ref_out, **_tolerance(dtype))
    torch.testing.assert_close(dh, ref_dh, **_tolerance(dtype))


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_equal_the_torch_expression(activation, dtype, shape):
    h, grad = inputs(shape, dtype, device="cuda")
    with gated.kernels_enabled(True):
        assert gated.implementation(h, activation) is KERNELS[activation]
        out, dh = forward_backward(FUNCTIONS[activation], h, grad)
    _check(out, dh, h, grad, activation, dtype)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_non_contiguous_inputs_and_output_gradients(activation, dtype):
    ffn, rows = 1000, 24
    wide, grad_wide = inputs((rows, 2 * ffn + 40), dtype, seed=1, device="cuda")
    cases = {
        "rows-apart": (wide[:, :2 * ffn], grad_wide[:, :ffn]),                 # a view: rows 2F + 40 apart
        "transposed": (wide[:, :2 * ffn].t().contiguous().t(), grad_wide[:, 5:5 + ffn].t().contiguous().t()),
        "3d-permuted": (wide[:, :2 * ffn].reshape(4, 6, 2 * ffn).transpose(0, 1),
                        grad_wide[:, :ffn].reshape(4, 6, ffn).transpose(0, 1)),
    }
    for name, (h, grad) in cases.items():
        assert not h.is_contiguous(), name
        with gated.kernels_enabled(True):
            out, dh = forward_backward(FUNCTIONS[activation], h, grad)
        _check(out, dh, h, grad, activation, dtype)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_compiled_one_graph_that_launches_the_kernels_same_numbers(activation, dtype):
    """The custom operators stay in inductor's graph (no break) and the result equals the eager kernels'. F = 1000:
    inductor pads the rows of its own [.., 2000] buffers (to 2016 columns); the operators, called with the real
    tensors, must not care (as ``triton_op``s traced into the graph they wrote 2000-column rows into the padded
    backward output: garbage on an H200, torch 2.11)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inductor_recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(inductor_recording)
    fn = FUNCTIONS[activation]
    def body(h):   # exact operations around it (powers of two), so no rounding differs but the activation's
        return fn(h * 2.0) * 0.5

    compiled = torch.compile(body, backend=counter, fullgraph=True)
    h, grad = inputs((3, 8, 2 * 1000), dtype, seed=2, device="cuda")
    with gated.kernels_enabled(True):
        out, dh = forward_backward(compiled, h, grad)
        eager_out, eager_dh = forward_backward(body, h, grad)
    assert counter.frame_count == 1
    assert any("lightning_megatron.gated_activation" in g for g in graphs), graphs
    torch.testing.assert_close(out, eager_out, **_tolerance(dtype))
    torch.testing.assert_close(dh, eager_dh, **_tolerance(dtype))
    with gated.kernels_enabled(False):   # the switch is read when tracing: off, the graph has no kernel
        torch._dynamo.reset()
        graphs.clear()
        off_out, off_dh = forward_backward(compiled, h, grad)
    assert graphs and not any("gated_activation" in g for g in graphs), graphs
    # inductor's own fusion of the torch expression: its float32 GeGLU backward cancels as torch's does
    torch.testing.assert_close(off_out, eager_out, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(off_dh, eager_dh, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_mlp_with_the_kernels_equals_the_torch_expression(one_rank, activation):
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.transformer.mlp import MLP

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=200,
                               activation=activation, add_bias_linear=False)
    mlp = MLP(config).cuda()
    x0, g = torch.randn(16, 2, 64, device="cuda"), torch.randn(16, 2, 64, device="cuda")
    results = {}
    for kernels in (True, False):
        mlp.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with gated.kernels_enabled(kernels):
            out = mlp(x)
        out.backward(g)
        results[kernels] = (out.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()})
    (out, dx, grads), (ref_out, ref_dx, ref_grads) = results[True], results[False]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
