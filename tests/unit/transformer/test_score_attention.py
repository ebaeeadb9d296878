"""Score variants of attention (sliding window, soft-capping, custom scale): ``variant_attention`` equals Hugging
Face's Gemma-2 eager attention (``eager_attention_forward``, with the masks of ``masking_utils``' own mask
functions) in outputs and gradients, on every kernel, with grouped-query attention, padding and packed
documents; and its masks are built once and shared."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import masking_utils
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from lightning_megatron.transformer import score_attention
from lightning_megatron.transformer.documents import DocumentMask
from lightning_megatron.transformer.score_attention import explicit_attention, pick_kernel, variant_attention

SEQ, HEADS, DIM = 24, 4, 8
LENGTHS = ([7, 5, 9], [4, 20])   # two packed rows: documents of 7, 5, 9 tokens and 3 of padding; 4, 20
TOL = dict(atol=1e-5, rtol=1e-5)
flex_warning = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def packed_ids(lengths=LENGTHS, seq=SEQ):
    """``document_ids [len(lengths), seq]``: 0, 1, ... per document, -1 on padding."""
    docs = torch.full((len(lengths), seq), -1, dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        at = 0
        for k, n in enumerate(row_lengths):
            docs[row, at:at + n] = k
            at += n
    return docs


def padding(left=False):
    """``attention_mask [2, SEQ]``: row 0 ends in 5 padded tokens (or, ``left``, starts with them), row 1 has none."""
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if left:
        mask[0, :5] = 0
    else:
        mask[0, -5:] = 0
    return mask


def hf_visible(causal, window, attention_mask, documents):
    """Boolean ``[b, 1, s, s]`` from transformers' own mask functions, evaluated on index grids."""
    mods = [masking_utils.causal_mask_function if causal else masking_utils.bidirectional_mask_function]
    if window is not None:
        mods.append(masking_utils.sliding_window_overlay(window))
    if attention_mask is not None:
        mods.append(masking_utils.padding_mask_function(attention_mask.bool()))
    if documents is not None:
        mods.append(masking_utils.packed_sequence_mask_function(documents))
    index = torch.arange(SEQ)
    batch = torch.arange(2)[:, None, None, None]
    visible = masking_utils.and_masks(*mods)(batch, torch.zeros(()), index[:, None], index[None, :])
    return visible.expand(2, 1, SEQ, SEQ)


def hf_attention(q, k, v, visible, scale=None, softcap=None, dropout=0.0):
    """transformers' Gemma-2 eager attention with its additive mask (0 visible, finfo.min hidden), ``[b, H, s, d]``."""
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=dropout > 0, head_dim=q.shape[-1])
    additive = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module, q, k, v, additive, dropout=dropout, scaling=scale, softcap=softcap)
    return out.transpose(1, 2)


def inputs(kv_heads=HEADS, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(2, HEADS, SEQ, DIM, generator=gen)).requires_grad_()
    k, v = ((scale * torch.randn(2, kv_heads, SEQ, DIM, generator=gen)).requires_grad_() for _ in range(2))
    return q, k, v


CASES = {   # name: (kv heads, variant_attention keywords, padding on the left); few distinct values: each new
    # one retraces FlexAttention (~0.5 s on a CPU)
    "window": (HEADS, dict(window=5), False),
    "softcap": (HEADS, dict(softcap=2.0), False),
    "scale": (HEADS, dict(scale=0.5), False),
    "window+softcap+scale": (HEADS, dict(window=5, softcap=2.0, scale=0.5), False),
    "gqa": (2, dict(window=5, softcap=2.0), False),
    "mqa": (1, dict(window=5, softcap=2.0), False),
    "padding": (HEADS, dict(window=5, attention_mask=padding()), False),
    "left-padding+softcap": (HEADS, dict(window=3, softcap=2.0, attention_mask=padding(left=True)), True),
    "documents": (HEADS, dict(window=5, documents=packed_ids()), False),
    "documents+softcap": (2, dict(window=5, softcap=2.0, documents=packed_ids()), False),
    "all": (2, dict(window=5, softcap=2.0, scale=0.5, attention_mask=padding(), documents=packed_ids()), False),
    "non-causal": (2, dict(causal=False, softcap=2.0, scale=0.5, attention_mask=padding(), documents=packed_ids()),
                   False),
}


@flex_warning
@pytest.mark.parametrize("case", list(CASES))
def test_variant_attention_equals_transformers_gemma2_eager(case):
    """Mask path: outputs and gradients of q, k, v equal transformers' (rows with no visible key, under left
    padding, give zeros here and are left out of the comparison); flex path (CPU: forward only): outputs."""
    kv_heads, kw, left = CASES[case]
    q, k, v = inputs(kv_heads, scale=2.0)   # larger scores, so the cap bends them
    visible = hf_visible(kw.get("causal", True), kw.get("window"), kw.get("attention_mask"), kw.get("documents"))
    some = visible.any(-1, keepdim=True)                                    # [b, 1, s, 1]
    assert not left or not some.all()   # left padding: some queries see no key at all
    ref = hf_attention(q, k, v, visible, kw.get("scale"), kw.get("softcap"))
    got = variant_attention(q, k, v, kernel="mask", **kw)
    torch.testing.assert_close(got * some, ref * some, **TOL)
    assert not got.isnan().any() and not got[~some.expand_as(got)].any()   # empty rows: zeros
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)) * some
    grads = torch.autograd.grad(got, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m: f"{case}, d{name}: {m}")
    with torch.no_grad():
        flex = variant_attention(q, k, v, kernel="flex", **kw)
    torch.testing.assert_close(flex * some, ref * some, **TOL)


@pytest.mark.parametrize("case", [c for c in CASES if "softcap" not in CASES[c][1]])
def test_sdpa_and_explicit_math_agree_where_both_apply(case):
    """Without a cap the mask path runs SDPA; the explicit math (the capped path) gives the same outputs and
    gradients on the same keep-mask, empty rows (zeros) included."""
    kv_heads, kw, _ = CASES[case]
    q, k, v = inputs(kv_heads)
    docs = kw.get("documents")
    keep = score_attention.keep_mask(SEQ, q.device, causal=kw.get("causal", True), window=kw.get("window"),
                                     attention_mask=kw.get("attention_mask"),
                                     documents=None if docs is None else DocumentMask(docs))
    sdpa = variant_attention(q, k, v, kernel="mask", **kw)
    explicit = explicit_attention(q, k, v, keep, scale=kw.get("scale"), softcap=None, dropout_p=0.0)
    torch.testing.assert_close(explicit, sdpa, **TOL)
    upstream = torch.randn(sdpa.shape, generator=torch.Generator().manual_seed(1))
    for g, r in zip(torch.autograd.grad(explicit, (q, k, v), upstream), torch.autograd.grad(sdpa, (q, k, v), upstream)):
        torch.testing.assert_close(g, r, **TOL)
    left = padding(left=True)   # rows with no visible key: zeros from both, no NaN
    keep = score_attention.keep_mask(SEQ, q.device, causal=True, window=3, attention_mask=left, documents=None)
    torch.testing.assert_close(explicit_attention(q, k, v, keep, scale=None, softcap=None, dropout_p=0.0),
                               variant_attention(q, k, v, window=3, attention_mask=left), **TOL)


def test_capped_dropout_draws_like_transformers():
    """With dropout the capped path drops the probabilities as transformers does: the same draws for one seed."""
    q, k, v = inputs(2)
    kw = dict(window=5, softcap=2.0, documents=packed_ids())
    torch.manual_seed(3)
    ref = hf_attention(q, k, v, hf_visible(True, 5, None, packed_ids()), softcap=2.0, dropout=0.25)
    torch.manual_seed(3)
    got = variant_attention(q, k, v, dropout_p=0.25, **kw)
    torch.testing.assert_close(got, ref, **TOL)
    assert not torch.allclose(got, variant_attention(q, k, v, **kw), atol=1e-3)
    torch.manual_seed(3)   # the uncapped (SDPA) path drops too, reproducibly for one seed
    a = variant_attention(q, k, v, dropout_p=0.25, window=5)
    torch.manual_seed(3)
    torch.testing.assert_close(variant_attention(q, k, v, dropout_p=0.25, window=5), a)
    assert not torch.allclose(a, variant_attention(q, k, v, window=5), atol=1e-3)


@flex_warning
@pytest.mark.parametrize("kernel", ["mask", "flex"])
def test_window_limits(kernel):
    """``window >= s`` is plain causal attention; ``window=1`` leaves each token only itself: its value."""
    q, k, v = inputs(2)
    with torch.no_grad():
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        for window in (SEQ, SEQ + 7):
            torch.testing.assert_close(variant_attention(q, k, v, window=window, kernel=kernel), causal, **TOL)
        alone = v.repeat_interleave(HEADS // 2, dim=1)
        torch.testing.assert_close(variant_attention(q, k, v, window=1, kernel=kernel), alone, **TOL)
        torch.testing.assert_close(variant_attention(q, k, v, window=1, softcap=2.0, kernel=kernel), alone, **TOL)
        if kernel == "mask":   # window 2: the token and the one before it (the first token alone)
            two = variant_attention(q, k, v, window=2, kernel=kernel)
            torch.testing.assert_close(two[:, :, :1], alone[:, :, :1], **TOL)
            assert not torch.allclose(two[:, :, 1:], alone[:, :, 1:], atol=1e-3)


def test_errors_name_the_parameter_and_the_fix():
    q, k, v = inputs(2)
    cases = [
        (dict(window=0), r"window \(sliding_window\) must be a positive number of tokens or None, got 0"),
        (dict(window=True), r"window \(sliding_window\) must be a positive number of tokens or None, got True"),
        (dict(window=4, causal=False), "sliding_window=4 with non-causal attention.*use sliding_window=None"),
        (dict(softcap=0.0), r"softcap \(attention logit soft-capping\) must be a positive number or None, got 0.0"),
        (dict(scale=-1.0), r"scale \(the softmax scale, default head_dim \*\* -0.5\) must be positive or None"),
        (dict(dropout_p=1.0), r"dropout_p \(attention_dropout\) must be in \[0, 1\), got 1.0"),
        (dict(attention_mask=torch.ones(2, SEQ - 1)), r"attention_mask has shape \(2, 23\) but attention sees 2 "
                                                      r"sequences of 24 tokens"),
        (dict(documents=packed_ids()[:, :-1]), r"document_ids has shape \(2, 23\) but attention sees 2 sequences"),
        (dict(kernel="fast"), r"document_attention='fast' is not one of \['auto', 'flex', 'mask'\]"),
        (dict(kernel="flex", window=4), "document_attention='flex' on a CPU cannot train"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            variant_attention(q, k, v, **kw)
    with pytest.raises(ValueError, match="a number of kv heads that divides the 4 query heads"):
        variant_attention(q, k[:, :1].expand(2, 3, SEQ, DIM), v[:, :1].expand(2, 3, SEQ, DIM))
    with pytest.raises(ValueError, match=r"q must be \[b, heads, s, d\] and k, v both"):
        variant_attention(q, k, v[..., :4])


def test_auto_kernel_choice():
    """``"auto"``: flex on CUDA for the variants without dropout and with heads of >= 16 channels; SDPA otherwise,
    and for plain attention, whose fused kernels are faster."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pick_kernel("auto", cuda, 0.0, True, 64, plain=False) == "flex"
    assert pick_kernel("auto", cuda, 0.0, True, 64, plain=True) == "mask"
    assert pick_kernel("auto", cuda, 0.1, True, 64, plain=False) == "mask"
    assert pick_kernel("auto", cuda, 0.0, True, 8, plain=False) == "mask"
    assert pick_kernel("auto", cpu, 0.0, False, 64, plain=False) == "mask"
    assert pick_kernel("flex", cuda, 0.0, True, 64, plain=True) == "flex"


@flex_warning
def test_masks_are_built_once_and_shared():
    """One keep-mask and one block mask per DocumentMask (what a block hands all its layers), keyed by the
    window; without documents a bounded cache; none of them inference tensors (which cannot train)."""
    q, k, v = inputs(2)
    docs = DocumentMask(packed_ids())
    for window in (4, 4, 6, None):
        variant_attention(q, k, v, window=window, documents=docs, kernel="mask")
        block = score_attention.flex_block_mask(SEQ, q.device, causal=True, window=window, documents=docs)
        assert score_attention.flex_block_mask(SEQ, q.device, causal=True, window=window, documents=docs) is block
    dense = [key for key in docs._cache if key[0] == "dense"]
    blocks = [key for key in docs._cache if key[0] == "block"]
    assert sorted(key[2] or 0 for key in dense) == sorted(key[2] or 0 for key in blocks) == [0, 4, 6]
    mask = padding()
    first = score_attention.keep_mask(SEQ, q.device, causal=True, window=4, attention_mask=mask, documents=docs)
    assert torch.equal(score_attention.keep_mask(SEQ, q.device, causal=True, window=4, attention_mask=mask,
                                                 documents=docs), first)
    other = score_attention.keep_mask(SEQ, q.device, causal=True, window=4, attention_mask=padding(left=True),
                                      documents=docs)
    assert not torch.equal(other, first)

    score_attention._MASKS.clear()
    with torch.inference_mode():   # validation first (Lightning's sanity check): its masks must still train
        variant_attention(q.detach(), k.detach(), v.detach(), window=5)
        variant_attention(q.detach(), k.detach(), v.detach(), window=5, documents=docs, kernel="mask")
    variant_attention(q, k, v, window=5).sum().backward()
    variant_attention(q, k, v, window=5, documents=docs, kernel="mask").sum().backward()
    assert len(score_attention._MASKS) == 1
    for s in range(2, 20):
        score_attention.keep_mask(s, q.device, causal=True, window=3, attention_mask=None, documents=None)
    assert len(score_attention._MASKS) == score_attention.CACHE_SIZE
    a = score_attention.keep_mask(SEQ, q.device, causal=True, window=3, attention_mask=None, documents=None)
    assert score_attention.keep_mask(SEQ, q.device, causal=True, window=3, attention_mask=None, documents=None) is a


def test_runs_whole_inside_torch_compile():
    """Compiled layers call it inside ``torch.compile``: one graph (``fullgraph``), its masks cached as in eager
    mode, outputs and gradients those of the eager call."""
    q, k, v = inputs(2)
    docs = DocumentMask(packed_ids())
    kw = dict(window=5, softcap=2.0, scale=0.5, attention_mask=padding(), kernel="mask")

    def attend(q, k, v, documents):
        return variant_attention(q, k, v, documents=documents, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    for _ in range(2):
        out = compiled(q, k, v, docs)
    ref = attend(q, k, v, docs)
    torch.testing.assert_close(out, ref, **TOL)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for g, r in zip(torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(ref, (q, k, v), upstream)):
        torch.testing.assert_close(g, r, **TOL)
    assert [key[0] for key in docs._cache] == ["dense"]
