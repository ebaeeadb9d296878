"""The project's Triton kernels on CPU tensors under Triton's interpreter, against their torch paths; run by
tests/unit/ops/test_kernels_interpreted.py in a process of its own (``TRITON_INTERPRET=1`` must be set before
Triton decorates a kernel). Prints one line per case and exits 1 if any differs.

The interpreter runs each program in numpy: it checks what a kernel computes (indexing, masks, the formula, the
rounding to the output dtype), not how fast; tests/gpu/ compares the compiled kernels on a GPU."""
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
import torch

results = {}

# -- gated activations
from lightning_megatron.ops import swiglu as gated
for F_, T, extra in ((1000, 5, 0), (3, 4, 0), (2500, 3, 40)):
    for dtype in (torch.float32, torch.bfloat16):
        for gelu in (False, True):
            wide = (torch.randn(T, 2 * F_ + extra) * 3).to(dtype)
            h, g = wide[:, :2 * F_], torch.randn(T, F_).to(dtype)
            out, dh = gated._run_forward(h, gelu), gated._run_backward(h, g, gelu)   # what the operators launch
            ref_h = h.double().requires_grad_()
            ref = (gated.torch_geglu if gelu else gated.torch_swiglu)(ref_h)
            ref.backward(g.double())
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
            ok = torch.allclose(out.double(), ref.detach().to(dtype).double(), **tol) and \
                torch.allclose(dh.double(), ref_h.grad.to(dtype).double(), **tol)
            results[f"{'geglu' if gelu else 'swiglu'} F={F_} {dtype}"] = ok

# the custom operators (as the layers call them) inside a compiled function, around inductor's own kernels, with
# rows wider than the columns (strided) on the way in: the operators read the real tensors' strides at run time
import torch._dynamo
for gelu in (False, True):
    kernel = gated.kernel_geglu if gelu else gated.kernel_swiglu

    def body(h, kernel=kernel):   # exact operations around it (powers of two): no rounding differs
        return kernel((h * 2.0)[:, :2000]) * 0.5

    torch._dynamo.reset()
    compiled = torch.compile(body, fullgraph=True)
    wide = torch.randn(6, 2016) * 3
    outs = []
    for fn in (compiled, body):
        h = wide.clone().requires_grad_()
        out = fn(h)
        out.backward(torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)))
        outs.append((out.detach(), h.grad))
    ref_h = wide.double().requires_grad_()
    ref = (gated.torch_geglu if gelu else gated.torch_swiglu)(ref_h[:, :2000] * 2.0) * 0.5
    ref.backward(torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)).double())
    close = dict(rtol=1e-5, atol=1e-5)
    results[f"{'geglu' if gelu else 'swiglu'} operators compiled (fwd, bwd)"] = all(
        torch.allclose(a, b, **close) for a, b in zip(outs[0], outs[1])) and \
        torch.allclose(outs[0][0].double(), ref.detach(), **close) and \
        torch.allclose(outs[0][1].double(), ref_h.grad, **close)

# -- the fused cross-entropy's statistics and gradient passes
from lightning_megatron.tensor_parallel import fused_cross_entropy as fce
import torch.distributed as dist
import tempfile
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
from lightning_megatron.parallel import ParallelLayout, ParallelState
ParallelState(ParallelLayout(1)).activate()
gen = torch.Generator().manual_seed(0)
for chunk in (None, 16):
    for smoothing in (0.0, 0.1):
        hidden = torch.randn(48, 32, generator=gen)
        weight = torch.randn(300, 32, generator=gen) * 0.3
        target = torch.randint(0, 290, (48,), generator=gen)
        target[::7] = -100
        runs = []
        for kernels in (False, True):
            fce._use_kernels = (lambda x: True) if kernels else (lambda x: False)
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss = fce.linear_cross_entropy(h, w, target, chunk_size=chunk, label_smoothing=smoothing, vocab_size=290)
            loss.backward(torch.rand(48, generator=torch.Generator().manual_seed(1)))
            runs.append((loss.detach(), h.grad, w.grad))
        results[f"fused loss chunk={chunk} smoothing={smoothing}"] = all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*runs))

# -- the float8 output layer's GEMMs around those passes (the GPU's path: the gradient pass writes D over the
#    float8 GEMM's logits, then D is cast): against the torch passes, to bf16 D's rounding moving e5m2 steps
from lightning_megatron.quantization.float8_output import Float8OutputLayer
hidden = torch.randn(64, 32, generator=gen).bfloat16()
weight = (torch.randn(320, 32, generator=gen) * 0.3).bfloat16()
target = torch.randint(0, 320, (64,), generator=gen)
runs = []
for kernels in (False, True):
    fce._use_kernels = (lambda x: True) if kernels else (lambda x: False)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fce.linear_cross_entropy(h, w, target, chunk_size=None,
                                    low_precision=Float8OutputLayer("output_layer", torch.nn.functional.linear,
                                                                    compile=False))
    loss.backward(torch.rand(64, generator=torch.Generator().manual_seed(2)))
    runs.append((loss.detach().float(), h.grad.float(), w.grad.float()))
results["float8 output layer around the fused loss's passes"] = all(
    ((a - b).norm() <= 2e-2 * b.norm()).item() for a, b in zip(*runs))

# -- MoE permute / unpermute
from lightning_megatron.ops import moe_permute as pk
import importlib
torch_permute = importlib.import_module("lightning_megatron.moe.permute")
for T, E, k, H in ((13, 4, 2, 16), (40, 8, 1, 24)):
    scores = torch.rand(T, E, generator=gen)
    top = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(routing_map, scores, torch.zeros_like(scores))
    tokens = torch.randn(T, H, generator=gen)
    num_out = T * k
    rows, slots, token_rows = pk.permute(tokens, routing_map, num_out)
    ref_slots = torch_permute.routed_slots(routing_map, num_out)
    ref_rows = tokens.index_select(0, ref_slots % T)
    back = pk.unpermute(rows, token_rows, slots, torch_permute.permute_probs(probs, slots))
    ref_back = torch_permute.unpermute(ref_rows, ref_slots, T, torch_permute.permute_probs(probs, ref_slots))
    results[f"permute T={T} E={E} k={k}"] = torch.equal(slots, ref_slots) and torch.equal(rows, ref_rows) and \
        torch.allclose(back, ref_back, rtol=1e-5, atol=1e-6)

for name, ok in results.items():
    print(("ok    " if ok else "WRONG ") + name)
sys.exit(0 if all(results.values()) else 1)
