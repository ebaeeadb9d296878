"""SDPA's kernels on our attention layout (queries ``[b, heads, s, d]`` as views of ``[s, b, heads, d]``), bf16,
causal, grouped-query: forward + backward time of each backend, and whether it equals the math reference.

    python benchmarks/bench_attention_backends.py            # the Llama-1B and 8B head shapes at s=4096
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"1b": dict(b=2, heads=32, kv=8, s=4096, d=64), "8b": dict(b=2, heads=32, kv=8, s=4096, d=128)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def inputs(shape: dict, expand: bool):
    b, h, kv, s, d = shape["b"], shape["heads"], shape["kv"], shape["s"], shape["d"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).permute(1, 2, 0, 3)
    k = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen).permute(1, 2, 0, 3)
    v = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen).permute(1, 2, 0, 3)
    tensors = [t.detach().requires_grad_() for t in (q, k, v)]
    return tensors


def step(q, k, v, expand: bool, grad):
    if expand:   # the key/value heads repeated for kernels without grouped-query support
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand and k.shape[1] != q.shape[1])
    out.backward(grad)
    return out


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for shape_name, shape in SHAPES.items():
        q, k, v = inputs(shape, False)
        grad = torch.randn_like(q)
        with sdpa_kernel(SDPBackend.MATH):
            ref = step(q, k, v, False, grad).float()
        ref_grads = [t.grad.float().clone() for t in (q, k, v)]
        for name, backend in BACKENDS.items():
            for expand in (False, True):
                for t in (q, k, v):
                    t.grad = None
                try:
                    with sdpa_kernel(backend):
                        out = step(q, k, v, expand, grad)
                        torch.cuda.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(10):
                            for t in (q, k, v):
                                t.grad = None
                            step(q, k, v, expand, grad)
                        end.record()
                        torch.cuda.synchronize()
                except RuntimeError as err:
                    print(f"{shape_name} {name} expand={expand}: unavailable ({str(err).splitlines()[0][:120]})")
                    continue
                err_out = (out.float() - ref).abs().max().item()
                err_grad = max((t.grad.float() - r).abs().max().item() for t, r in zip((q, k, v), ref_grads))
                print(f"{shape_name} {name} expand={expand}: {start.elapsed_time(end) / 10:.3f} ms fwd+bwd  "
                      f"max|out-math| {err_out:.2e}  max|grad-math| {err_grad:.2e}", flush=True)


if __name__ == "__main__":
    main()
