"""On a GPU: ``variant_attention``'s compiled FlexAttention kernel (sliding window, soft-capping, grouped-query,
packed documents) gives the mask kernel's outputs and gradients at a Gemma-like shape, in float32 and bf16, both
measured against a float64 reference; and it runs inside ``torch.compile`` (as compiled layers call it)."""

import pytest
import torch

from lightning_megatron.transformer import documents as documents_module
from lightning_megatron.transformer import score_attention
from lightning_megatron.transformer.documents import DocumentMask
from lightning_megatron.transformer.score_attention import variant_attention

pytestmark = pytest.mark.gpu

B, HEADS, GROUPS, SEQ, DIM = 2, 8, 2, 1024, 64
VARIANT = dict(window=256, softcap=50.0)
LENGTHS = ([300, 77, 400, 200], [640, 300])   # packed rows (the rest padding, id -1); not multiples of 128


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """float32 as IEEE float32 (no TF32) for the tight float32 bounds, whatever an earlier test set."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def packed_ids():
    docs = torch.full((B, SEQ), -1, dtype=torch.long)
    for row, lengths in enumerate(LENGTHS):
        at = 0
        for k, n in enumerate(lengths):
            docs[row, at:at + n] = k
            at += n
    return docs.cuda()


def inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, DIM, device="cuda", generator=gen) * 2   # scores of several units: the cap bends
    k, v = (torch.randn(B, GROUPS, SEQ, DIM, device="cuda", generator=gen) for _ in range(2))
    upstream = torch.randn(B, HEADS, SEQ, DIM, device="cuda", generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], upstream.to(dtype)


def forward_backward(q, k, v, upstream, kernel, docs):
    out = variant_attention(q, k, v, kernel=kernel, documents=None if docs is None else DocumentMask(docs), **VARIANT)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), upstream))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_equals_mask_kernel(dtype, packed):
    docs = packed_ids() if packed else None
    (q, k, v), upstream = inputs(dtype)
    flex = forward_backward(q, k, v, upstream, "flex", docs)
    mask = forward_backward(q, k, v, upstream, "mask", docs)
    exact = forward_backward(*(t.detach().double().requires_grad_() for t in (q, k, v)), upstream.double(), "mask",
                             docs)
    for name, f, m, r in zip(("out", "dq", "dk", "dv"), flex, mask, exact):
        f, m, r = f.double(), m.double(), r
        assert f.isfinite().all(), name
        flex_error, mask_error = (f - r).abs().max().item(), (m - r).abs().max().item()
        scale = r.abs().max().item()
        if dtype == torch.float32:
            assert flex_error <= 1e-4 * scale, (name, flex_error, mask_error, scale)
            torch.testing.assert_close(f, m, atol=1e-4 * scale, rtol=1e-4)
        else:   # bf16: rounding of ~2**-8 per value; flex no worse than the mask kernel, both near the reference
            assert flex_error <= 2 * mask_error + 1e-2 * scale, (name, flex_error, mask_error, scale)
            assert mask_error <= 3e-2 * scale, (name, mask_error, scale)
    assert "flex_attention" in documents_module._COMPILED


def test_auto_takes_flex_and_runs_inside_torch_compile(monkeypatch):
    """``kernel="auto"`` is the compiled FlexAttention on CUDA; a ``torch.compile``d caller (as compiled layers call
    it, the block's ``DocumentMask`` passed in) gets the eager call's outputs and gradients."""
    flex_calls = []
    flex_path = score_attention._flex_path
    monkeypatch.setattr(score_attention, "_flex_path", lambda *a, **kw: flex_calls.append(1) or flex_path(*a, **kw))
    docs = DocumentMask(packed_ids())
    (q, k, v), upstream = inputs(torch.float32)
    eager = forward_backward(q, k, v, upstream, "auto", docs.ids)
    assert flex_calls

    def attend(q, k, v, documents):
        return variant_attention(q, k, v, documents=documents, **VARIANT)

    out = torch.compile(attend)(q, k, v, docs)
    compiled = [out.detach()] + list(torch.autograd.grad(out, (q, k, v), upstream))
    for name, c, e in zip(("out", "dq", "dk", "dv"), compiled, eager):
        torch.testing.assert_close(c, e, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
