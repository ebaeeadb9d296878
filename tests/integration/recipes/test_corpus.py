"""The pre-training data path: token files, the preprocessing command, windows, packing and blending."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from lightning_megatron.recipes.corpus import (BlendedDataset, PackedDocuments, TokenFile, TokenWindows, blend_indices,
                                       write_token_file)
from lightning_megatron.recipes.corpus.preprocess import load_tokenizer, preprocess
from lightning_megatron.recipes.corpus.sample import write_sample_corpus


def _docs(n=30, seed=0, vocab=100):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, size=int(rng.integers(1, 40)))) for _ in range(n)]


def test_token_file_round_trip_and_dtype(tmp_path):
    docs = _docs()
    small = write_token_file(tmp_path / "small", docs, vocab_size=100)
    assert small.tokens.dtype == np.uint16 and small.num_documents == len(docs)
    for i, doc in enumerate(docs):
        assert small.document(i).tolist() == doc
    big = write_token_file(tmp_path / "big", [[70000, 1]], vocab_size=128256)
    assert big.tokens.dtype == np.int32 and big.document(0).tolist() == [70000, 1]
    with pytest.raises(ValueError, match="token id 100 is outside the vocabulary"):
        write_token_file(tmp_path / "bad", [[1, 100]], vocab_size=100)
    with pytest.raises(FileNotFoundError, match="lightning_megatron.recipes.corpus.preprocess"):
        TokenFile(tmp_path / "missing")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return write_sample_corpus(tmp_path_factory.mktemp("sample"), documents=200)


def test_preprocess_keeps_input_order_and_ends_documents(sample, tmp_path):
    tokenizer, _ = load_tokenizer(str(sample / "tokenizer"))
    texts = ["first document\nwith two lines", "second one", "third"]
    (tmp_path / "a.txt").write_text(f"{texts[0]}\n\n\n{texts[1]}\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": texts[2]}) + "\n")
    out = preprocess([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], str(sample / "tokenizer"),
                     str(tmp_path / "out"), workers=2, text_key="body", progress=False)
    eod = tokenizer.token_to_id("</s>")
    assert out.meta["eod_id"] == eod and out.num_documents == 3
    for i, text in enumerate(texts):
        assert out.document(i).tolist() == tokenizer.encode(text, add_special_tokens=False).ids + [eod]
    with pytest.raises(ValueError, match="--text-key"):
        preprocess([str(tmp_path / "b.jsonl")], str(sample / "tokenizer"), str(tmp_path / "x"), progress=False)


def test_preprocess_command_line(sample, tmp_path):
    run = subprocess.run([sys.executable, "-m", "lightning_megatron.recipes.corpus.preprocess", "--input",
                          str(sample / "valid.txt"), "--tokenizer", str(sample / "tokenizer"), "--output-prefix",
                          str(tmp_path / "valid")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "10 documents" in run.stdout and TokenFile(tmp_path / "valid").num_documents == 10


def test_windows_cover_the_shuffled_stream_in_order(tmp_path):
    corpus = write_token_file(tmp_path / "c", _docs(), vocab_size=100)
    seq, n = 16, 40
    windows = TokenWindows(corpus, seq, n, seed=3)
    stream = np.concatenate([corpus.document(int(d)) for d in windows.order])
    for i in range(n):
        start = int(windows.shuffle[i]) * seq
        item = windows[i]
        assert item["input_ids"].tolist() == stream[start:start + seq].tolist()
        assert item["labels"].tolist() == stream[start + 1:start + seq + 1].tolist()
    assert sorted(windows.shuffle.tolist()) == list(range(n))            # every window once
    again = TokenWindows(corpus, seq, n, seed=3)
    assert all(torch.equal(again[i]["input_ids"], windows[i]["input_ids"]) for i in range(n))
    assert not torch.equal(TokenWindows(corpus, seq, n, seed=4)[0]["input_ids"], windows[0]["input_ids"])


def test_packed_rows_hold_every_document_once_without_crossing(tmp_path):
    docs = _docs(n=25)                      # up to 39 tokens: some are longer than a row of 32 and are cut
    corpus = write_token_file(tmp_path / "c", docs, vocab_size=100)
    seq = 31
    packed = PackedDocuments(corpus, seq_length=seq, seed=1)
    covered = {d: [] for d in range(len(docs))}
    for i in range(len(packed)):
        row = packed[i]
        ids, labels, pos, doc = row["input_ids"], row["labels"], row["position_ids"], row["document_ids"]
        full = torch.cat([ids, torch.zeros(1, dtype=ids.dtype)])
        at = 0
        for k, (d, start, length) in enumerate(packed.rows[i]):
            assert length <= seq + 1
            covered[d].append((start, length))
            span = slice(at, min(at + length, seq))
            assert full[at:at + length][:span.stop - at].tolist() == docs[d][start:start + length][:span.stop - at]
            assert (doc[span] == k).all() and pos[span].tolist() == list(range(span.stop - at))
            assert (labels[at:span.stop - 1] == ids[at + 1:span.stop]).all()   # next token within the piece
            if span.stop - 1 < seq and at + length - 1 < seq:
                assert labels[at + length - 1] == -100                         # never into the next piece
            at += length
        assert (doc[at:] == -1).all() and (labels[at:] == -100).all()          # padding is never learned
    for d, pieces in covered.items():                                          # each document exactly once
        pieces.sort()
        assert [p[0] for p in pieces] == list(range(0, len(docs[d]), seq + 1))
        assert sum(p[1] for p in pieces) == len(docs[d])


def test_blend_keeps_the_proportions_in_every_prefix():
    which = blend_indices([0.3, 0.7], 1000)
    counts = np.cumsum(np.eye(2, dtype=int)[which], axis=0)
    n = np.arange(1, 1001)[:, None]
    assert np.abs(counts - n * np.array([0.3, 0.7])).max() <= 1.0
    for bad in ([], [1, -1], [0, 0], [float("nan")]):
        with pytest.raises(ValueError, match="blend weights"):
            blend_indices(bad, 10)


def test_blended_dataset_wraps_each_source(tmp_path):
    a = write_token_file(tmp_path / "a", _docs(seed=1), vocab_size=100)
    b = write_token_file(tmp_path / "b", _docs(seed=2), vocab_size=100)
    wa, wb = TokenWindows(a, 8, 3), TokenWindows(b, 8, 50)
    blend = BlendedDataset([wa, wb], [1, 1], 20)
    from_a = [blend[i]["input_ids"] for i in range(20) if blend.which[i] == 0]
    assert len(from_a) == 10
    for j, x in enumerate(from_a):
        assert torch.equal(x, wa[j % 3]["input_ids"])
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([wa, wb], [1], 5)
