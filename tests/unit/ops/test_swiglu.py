"""``ops/swiglu.py`` on the CPU: ``swiglu``/``geglu`` are exactly the torch expressions they replace (forward and
backward, float32 and bf16, compiled without a graph break), the MLP computes what it computed before, and the
dispatcher picks the Triton kernels only for CUDA tensors of the dtypes they take, with Triton importable and the
switch on. The kernels themselves: tests/gpu/test_swiglu_gpu.py."""

import pytest
import torch

from helpers.gated_activations import FUNCTIONS, REFERENCE, forward_backward, inputs, reference
from lightning_megatron.ops import swiglu as gated


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("shape", [(7, 2 * 6), (5, 3, 2 * 9)], ids=["2d", "3d"])
def test_equals_the_torch_expression_exactly(activation, dtype, shape):
    h, grad = inputs(shape, dtype)
    out, dh = forward_backward(FUNCTIONS[activation], h, grad)
    ref_out, ref_dh = forward_backward(reference(activation), h, grad)
    assert out.dtype == dtype and out.shape == shape[:-1] + (shape[-1] // 2,)
    assert torch.equal(out, ref_out) and torch.equal(dh, ref_dh)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_compiles_into_one_graph_with_the_same_numbers(activation, dtype):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")   # dynamo's graph through AOTAutograd, run as it is
    fn = FUNCTIONS[activation]
    compiled = torch.compile(lambda h: fn(h) * 2.0, backend=counter, fullgraph=True)   # fullgraph: a break raises
    h, grad = inputs((6, 2 * 10), dtype)
    out, dh = forward_backward(compiled, h, grad)
    ref_out, ref_dh = forward_backward(lambda h: reference(activation)(h) * 2.0, h, grad)
    assert counter.frame_count == 1
    assert torch.equal(out, ref_out) and torch.equal(dh, ref_dh)


class _CudaLike:
    """What the dispatcher reads of a tensor, for a CUDA tensor on a machine without one."""

    def __init__(self, dtype=torch.bfloat16, numel=8, width=8):
        self.is_cuda, self.dtype, self._numel, self.shape = True, dtype, numel, (numel // width, width)

    def numel(self):
        return self._numel


def test_kernels_only_for_cuda_tensors_with_triton_and_the_switch_on(monkeypatch):
    cpu = torch.ones(2, 8)
    monkeypatch.delenv(gated.ENV, raising=False)
    monkeypatch.setattr(gated, "triton", None)                   # no Triton: the torch expressions
    assert gated.implementation(_CudaLike()) is gated.torch_swiglu
    assert gated.implementation(_CudaLike(), "geglu") is gated.torch_geglu

    monkeypatch.setattr(gated, "triton", object())               # Triton importable
    assert gated.kernels_run(_CudaLike())
    assert gated.implementation(_CudaLike()) is gated.kernel_swiglu
    assert gated.implementation(_CudaLike(), "geglu") is gated.kernel_geglu
    for dtype in (torch.float16, torch.float32):
        assert gated.implementation(_CudaLike(dtype)) is gated.kernel_swiglu
    assert gated.implementation(cpu) is gated.torch_swiglu       # CPU tensors: the torch expression
    assert gated.implementation(cpu, "geglu") is gated.torch_geglu
    assert gated.implementation(_CudaLike(torch.float64)) is gated.torch_swiglu   # a dtype the kernels don't take
    assert gated.implementation(_CudaLike(numel=0)) is gated.torch_swiglu         # nothing to launch
    assert gated.implementation(_CudaLike(width=7, numel=7)) is gated.torch_swiglu   # odd: the torch error

    with gated.kernels_enabled(False):                           # switched off in a block
        assert gated.implementation(_CudaLike()) is gated.torch_swiglu
        with gated.kernels_enabled(True):
            assert gated.implementation(_CudaLike()) is gated.kernel_swiglu
    assert gated.implementation(_CudaLike()) is gated.kernel_swiglu
    monkeypatch.setenv("LM_SWIGLU_KERNELS", "0")                 # switched off by the environment
    assert gated.ENV == "LM_SWIGLU_KERNELS"
    assert gated.implementation(_CudaLike()) is gated.torch_swiglu
    assert gated.implementation(_CudaLike(), "geglu") is gated.torch_geglu
    monkeypatch.setenv("LM_SWIGLU_KERNELS", "1")
    assert gated.implementation(_CudaLike()) is gated.kernel_swiglu


def test_the_kernel_functions_exist_only_with_triton():
    """Without Triton the custom operators are not registered, and nothing asks for them."""
    registered = hasattr(torch.ops.lightning_megatron, "gated_activation")
    assert registered == (gated.triton is not None)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_mlp_computes_what_it_computed_before(one_rank, activation, dtype):
    """fc2(act(gate) * up) of fc1's output, as MLP.forward wrote it before it called ops/swiglu.py."""
    from lightning_megatron.transformer import TransformerConfig
    from lightning_megatron.transformer.mlp import MLP

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                               activation=activation, add_bias_linear=False, params_dtype=dtype)
    mlp = MLP(config)
    x0 = torch.randn(5, 2, 16).to(dtype)
    g = torch.randn(5, 2, 16).to(dtype)

    def run(forward):
        mlp.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = forward(x)
        out.backward(g)
        return out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}

    def before(x):
        gate, up = mlp.fc1(x).chunk(2, dim=-1)
        return mlp.fc2(REFERENCE[activation](gate, up))

    out, dx, grads = run(mlp)
    ref_out, ref_dx, ref_grads = run(before)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name
