"""Packed rows (several documents per row, ``document_ids``): attention never crosses a document, so every
token's output equals running its document alone as a sequence of its own (positions restarting). The
parallel layouts' equality with one process on packed batches is test_llama_strategy.py's (packed-* cases)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.tensor_parallel import get_rng_tracker
from lightning_megatron.testing import run_on_ranks
from lightning_megatron.transformer.documents import DocumentMask, document_attention

# two packed rows of 24 tokens: documents of 7, 5, 9 tokens and 3 of padding; 4, 20
LENGTHS = ([7, 5, 9], [4, 20])
SEQ = 24


def packed_ids(lengths=LENGTHS, seq=SEQ):
    """``document_ids`` and ``position_ids`` ``[len(lengths), seq]`` (-1 and 0 on padding)."""
    docs = torch.full((len(lengths), seq), -1, dtype=torch.long)
    positions = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        at = 0
        for k, n in enumerate(row_lengths):
            docs[row, at:at + n], positions[row, at:at + n] = k, torch.arange(n)
            at += n
    return docs, positions


def spans(lengths=LENGTHS):
    """(row, start, end) of every document."""
    for row, row_lengths in enumerate(lengths):
        starts = np.cumsum([0] + row_lengths[:-1])
        yield from ((row, int(s), int(s) + n) for s, n in zip(starts, row_lengths))


def per_document_attention(q, k, v, causal):
    """The reference: each document alone through plain SDPA (padding: one more document)."""
    docs, _ = packed_ids()
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        for doc in docs[row].unique():
            at = (docs[row] == doc).nonzero().flatten()
            out[row, :, at] = F.scaled_dot_product_attention(q[row:row + 1, :, at], k[row:row + 1, :, at],
                                                             v[row:row + 1, :, at], is_causal=causal,
                                                             enable_gqa=k.shape[1] != q.shape[1])[0]
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])   # 2: grouped-query attention
def test_document_attention_equals_each_document_alone(causal, kv_heads):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, SEQ, 8, generator=gen, requires_grad=True) for _ in range(2))
    docs, _ = packed_ids()
    got = document_attention(q, k, v, docs, causal=causal, kernel="mask")
    ref = per_document_attention(q, k, v, causal)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad():   # the CUDA kernel's mask (FlexAttention runs forward-only on a CPU)
        flex = document_attention(q, k, v, DocumentMask(docs), causal=causal, kernel="flex")
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_document_attention_errors_name_the_parameter():
    q = torch.randn(2, 4, SEQ, 8)
    docs, _ = packed_ids()
    with pytest.raises(ValueError, match=r"document_ids has shape \(2, 23\) but attention sees 2 sequences of 24"):
        document_attention(q, q, q, docs[:, :-1])
    with pytest.raises(ValueError, match="document_ids must be an integer tensor"):
        document_attention(q, q, q, docs.float())
    with pytest.raises(ValueError, match="document_attention='flex' on a CPU cannot train"):
        document_attention(q.requires_grad_(), q, q, docs, kernel="flex")
    from lightning_megatron.transformer import TransformerConfig

    with pytest.raises(ValueError, match="document_attention='flex' with attention_dropout=0.1: FlexAttention has no"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, document_attention="flex")
    with pytest.raises(ValueError, match=r"document_attention='fast' is not one of \['auto', 'flex', 'mask'\]"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, document_attention="fast")


VOCAB = 50


def _models_per_document():
    """GPT (learned positions, multi-head) and Llama (RoPE, grouped-query) in float32: logits of the packed
    rows, of each document alone, and of the packed rows with the flex kernel (forward-only here)."""
    from lightning_megatron.models import GPTModel
    from lightning_megatron.models.llama import LlamaModel, llama_config
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer import TransformerConfig

    ParallelState(ParallelLayout(1)).activate()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    docs, positions = packed_ids()
    shape = dict(num_layers=2, hidden_size=16, num_attention_heads=4)
    configs = {
        "gpt": lambda **kw: GPTModel(TransformerConfig(hidden_dropout=0.0, attention_dropout=0.0, **shape, **kw),
                                     VOCAB, SEQ),
        "llama": lambda **kw: LlamaModel(llama_config(num_query_groups=2, ffn_hidden_size=32, **shape, **kw),
                                         VOCAB, SEQ),
    }
    out = {}
    for name, build in configs.items():
        model = build()
        packed = model(ids, position_ids=positions, document_ids=docs)
        alone = [model(ids[row:row + 1, start:end])[0] for row, start, end in spans()]
        crossing = model(ids, position_ids=positions)   # positions restart, attention crosses documents
        flex = build(document_attention="flex")
        flex.load_state_dict(model.state_dict())
        with torch.no_grad():
            flex_packed = flex(ids, position_ids=positions, document_ids=docs)
        out[name] = (packed.detach(), [a.detach() for a in alone], crossing.detach(), flex_packed)
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")   # CPU: forward reference
def test_packed_rows_equal_each_document_alone():
    out = run_on_ranks(_models_per_document, 1, timeout=120)[0]
    for name, (packed, alone, crossing, flex_packed) in out.items():
        for (row, start, end), ref in zip(spans(), alone):
            torch.testing.assert_close(packed[row, start:end], ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}, row {row} tokens {start}:{end}: {m}")
            torch.testing.assert_close(flex_packed[row, start:end], ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} (flex), row {row} tokens {start}:{end}: {m}")
        # the first document of a row sees nothing before it either way; the later ones must differ
        row, start, end = list(spans())[1]
        assert not torch.allclose(crossing[row, start:end], packed[row, start:end], atol=1e-4), name


def _partial_graphs_refuse_document_ids():
    from lightning_megatron.cuda_graphs import PartialCudaGraphs, layer_chunks
    from lightning_megatron.cuda_graphs.errors import CudaGraphError
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer import TransformerBlock, TransformerConfig

    state = ParallelState(ParallelLayout(1)).activate()
    docs, _ = packed_ids()
    hidden = torch.randn(SEQ, 2, 16)
    messages = {}
    for scope in ("layer", ["attn"], ["mlp"]):
        block = TransformerBlock(TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                                                   hidden_dropout=0.0, attention_dropout=0.0))
        graphs = PartialCudaGraphs(layer_chunks(block), scope=scope, backend="eager", rng_tracker=get_rng_tracker(state))
        graphs.begin_step([1, -1])
        try:
            block(hidden, document_ids=docs).sum().backward()
            messages[str(scope)] = None
        except CudaGraphError as error:
            messages[str(scope)] = str(error)
    return messages


def test_partial_cuda_graphs_refuse_document_ids_by_name():
    messages = run_on_ranks(_partial_graphs_refuse_document_ids, 1, timeout=120)[0]
    for scope in ("layer", "['attn']"):
        assert "called with document_ids (packed documents' attention masks)" in messages[scope], messages
        assert "cuda_graph_scope=['mlp']" in messages[scope]
    assert messages["['mlp']"] is None   # attention runs eagerly, with the documents


def _recipe_batch_per_document(prefix):
    """A packed batch from PretrainingData through LlamaPretraining: its per-token losses, and each
    document's losses computed alone."""
    from lightning_megatron.recipes.corpus import PretrainingData
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.recipes.pretrain import LlamaPretraining

    ParallelState(ParallelLayout(1)).activate()
    data = PretrainingData([prefix], seq_length=SEQ, batch_size=2, packed=True, train_samples=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module = LlamaPretraining(vocab_size=VOCAB, seq_length=SEQ, num_layers=2, hidden_size=16, num_attention_heads=4,
                              num_query_groups=2, ffn_hidden_size=32)
    module.configure_model()
    losses = module(batch).detach()
    alone = []
    for row in range(2):
        for doc in batch["document_ids"][row].unique().tolist():
            if doc < 0:
                continue
            at = (batch["document_ids"][row] == doc).nonzero().flatten()
            single = {key: batch[key][row:row + 1, at] for key in ("input_ids", "labels", "position_ids")}
            alone.append((row, at, module(single)[0].detach()))
    return batch, losses, alone


def test_recipe_passes_document_ids_from_packed_data(tmp_path):
    from lightning_megatron.recipes.corpus import write_token_file

    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, VOCAB, size=int(rng.integers(3, 12)))) for _ in range(12)]
    write_token_file(tmp_path / "train", docs, vocab_size=VOCAB)
    batch, losses, alone = run_on_ranks(_recipe_batch_per_document, 1, str(tmp_path / "train"), timeout=120)[0]
    assert {"position_ids", "document_ids"} <= batch.keys()
    assert any(int(d.max()) >= 1 for d in batch["document_ids"]), "the rows should hold several documents"
    crossed = 0
    for row, at, ref in alone:
        torch.testing.assert_close(losses[row, at], ref, atol=1e-5, rtol=1e-5)
        crossed += int(at[0]) > 0
    assert crossed > 0   # some document starts mid-row: it would see its neighbours without document_ids


@pytest.mark.gpu
def test_gpu_flex_kernel_trains_like_the_mask_kernel():
    """On CUDA ``document_attention="auto"`` is compiled FlexAttention: a Llama (RoPE, grouped-query) gives the
    mask kernel's per-document losses and gradients, in float32 and under bf16 autocast (with recomputation)."""
    out = run_on_ranks(_flex_and_mask_on_cuda, 1, timeout=600)[0]
    for dtype, (flex, mask) in out.items():
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(flex[0], mask[0], **tol)
        for name in mask[1]:
            torch.testing.assert_close(flex[1][name], mask[1][name], **tol, msg=lambda m: f"{dtype} {name}: {m}")


def _flex_and_mask_on_cuda():
    from lightning_megatron.models.llama import LlamaModel, llama_config
    from lightning_megatron.parallel import ParallelLayout, ParallelState
    from lightning_megatron.transformer import documents

    ParallelState(ParallelLayout(1)).activate()
    seq = 500   # not a multiple of FlexAttention's 128-token blocks
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen).cuda()
    docs, positions = packed_ids(([100, 37, 200, 150], [300, 180]), seq)
    docs, positions = docs.cuda(), positions.cuda()
    out = {}
    for dtype in ("float32", "bfloat16"):
        runs = []
        for kernel in ("auto", "mask"):
            torch.manual_seed(0)
            model = LlamaModel(llama_config(num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=2,
                                            ffn_hidden_size=128, document_attention=kernel,
                                            recompute_layers=dtype == "bfloat16"), VOCAB, seq).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                losses = model(ids, position_ids=positions, labels=ids, document_ids=docs)
            losses.mean().backward()
            runs.append((losses.detach().float().cpu(),
                         {n: p.grad.float().cpu() for n, p in model.named_parameters()}))
        out[dtype] = runs
    assert "flex_attention" in documents._COMPILED   # "auto" took the flex kernel
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_chunks_keep_to_their_documents(cp, causal):
    """Each cp rank's load-balanced chunks against the whole sequence's keys and their document ids (what
    ``context_parallel_attention`` gathers) give that rank's slice of the whole row's document attention."""
    from lightning_megatron.context_parallel import split_for_context_parallel
    from lightning_megatron.transformer.context_parallel import local_query_attention

    gen = torch.Generator().manual_seed(cp)
    docs, _ = packed_ids()
    q = torch.randn(2, 4, SEQ, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, SEQ, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = per_document_attention(q, k, v, causal)
    for r in range(cp):
        out = local_query_attention(split_for_context_parallel(q, cp, r, seq_dim=2), k, v, None, causal, 0.0, cp, r,
                                    split_for_context_parallel(docs, cp, r, seq_dim=1), docs)
        torch.testing.assert_close(out, split_for_context_parallel(ref, cp, r, seq_dim=2))
