"""Training samples cut from token files, the same on every rank and in every resumed run.

Each dataset is a deterministic function of (token file, sequence length, number of samples, seed):
map-style, so the strategy's resumable loader restarts mid-epoch at the exact sample.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .token_file import TokenFile


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class TokenWindows(Dataset):
    """``num_samples`` windows of ``seq_length + 1`` tokens over the corpus read as one stream (Megatron's
    GPT dataset): each epoch takes the documents in a new shuffled order, windows run across document
    boundaries, and the windows themselves are shuffled. Item: ``input_ids``/``labels`` ``[seq_length]``."""

    def __init__(self, corpus: TokenFile, seq_length: int, num_samples: int, seed: int = 0) -> None:
        _check_positive("seq_length", seq_length)
        _check_positive("num_samples", num_samples)
        if corpus.num_tokens <= seq_length:
            raise ValueError(f"the corpus {corpus.prefix!r} holds {corpus.num_tokens} tokens, fewer than one sample of "
                             f"seq_length + 1 = {seq_length + 1}; use more text or a shorter seq_length.")
        self.corpus, self.seq_length, self.num_samples = corpus, seq_length, num_samples
        needed = num_samples * seq_length + 1
        epochs = -(-needed // corpus.num_tokens)
        rng = np.random.default_rng(seed)
        self.order = np.concatenate([rng.permutation(corpus.num_documents) for _ in range(epochs)])
        self.ends = np.cumsum(corpus.document_lengths[self.order])   # stream offset where each document ends
        self.shuffle = rng.permutation(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def _stream(self, start: int, length: int) -> np.ndarray:
        out: List[np.ndarray] = []
        k = int(np.searchsorted(self.ends, start, side="right"))
        while length > 0:
            doc = int(self.order[k])
            begin = int(self.ends[k] - self.corpus.document_lengths[doc])
            piece = self.corpus.document(doc)[start - begin:start - begin + length]
            out.append(piece)
            start += len(piece)
            length -= len(piece)
            k += 1
        return np.concatenate(out).astype(np.int64)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        tokens = torch.from_numpy(self._stream(int(self.shuffle[i]) * self.seq_length, self.seq_length + 1))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class PackedDocuments(Dataset):
    """Whole documents packed into rows of ``seq_length + 1`` tokens (best fit in a shuffled order, O(log row) per document; a
    document longer than a row is cut into row-sized pieces). Item: ``input_ids``, ``labels``,
    ``position_ids`` restarting at 0 in each document, ``document_ids`` (0, 1, ... within the row; -1 on
    padding) for attention that must not cross documents, and ``labels`` set to ``ignore_index`` where the
    next token belongs to another document or to padding."""

    def __init__(self, corpus: TokenFile, seq_length: int, seed: int = 0, pad_id: int = 0,
                 ignore_index: int = -100) -> None:
        _check_positive("seq_length", seq_length)
        self.corpus, self.seq_length, self.pad_id, self.ignore_index = corpus, seq_length, pad_id, ignore_index
        row = seq_length + 1
        pieces: List[tuple] = []   # (document, start, length)
        for doc in np.random.default_rng(seed).permutation(corpus.num_documents):
            length = int(corpus.document_lengths[doc])
            pieces.extend((int(doc), s, min(row, length - s)) for s in range(0, length, row))
        rows: List[List[tuple]] = []
        rooms: List[int] = []                  # the distinct free room sizes of open rows, sorted
        open_rows: Dict[int, List[int]] = {}   # free room -> the rows with that much room
        for piece in pieces:   # best fit: a row with the least room that still holds the piece
            k = bisect.bisect_left(rooms, piece[2])
            if k < len(rooms):
                room = rooms[k]
                r = open_rows[room].pop()
                if not open_rows[room]:
                    del open_rows[room], rooms[k]
                rows[r].append(piece)
            else:
                room, r = row, len(rows)
                rows.append([piece])
            left = room - piece[2]
            if left > 0:
                if left not in open_rows:
                    open_rows[left] = []
                    bisect.insort(rooms, left)
                open_rows[left].append(r)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        row = self.seq_length + 1
        tokens = np.full(row, self.pad_id, dtype=np.int64)
        positions = np.zeros(row, dtype=np.int64)
        documents = np.full(row, -1, dtype=np.int64)
        at = 0
        for k, (doc, start, length) in enumerate(self.rows[i]):
            tokens[at:at + length] = self.corpus.document(doc)[start:start + length]
            positions[at:at + length] = np.arange(length)
            documents[at:at + length] = k
            at += length
        labels = tokens[1:].copy()
        labels[documents[1:] != documents[:-1]] = self.ignore_index   # no prediction across documents
        labels[documents[1:] < 0] = self.ignore_index
        return {"input_ids": torch.from_numpy(tokens[:-1]), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions[:-1]), "document_ids": torch.from_numpy(documents[:-1])}


def blend_indices(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """Which dataset each of ``num_samples`` samples comes from: at every step the dataset furthest behind
    its share (Megatron's blending), so any prefix of the blend has the weights' proportions."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative numbers with a positive sum, got {list(weights)!r}.")
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    out = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        k = int(np.argmax(w * (i + 1) - counts))
        out[i] = k
        counts[k] += 1
    return out


class BlendedDataset(Dataset):
    """``num_samples`` samples drawn from ``datasets`` in the proportions ``weights`` (deterministic; each
    dataset's samples are taken in its own order, wrapping around when it runs out)."""

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], num_samples: int) -> None:
        _check_positive("num_samples", num_samples)
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} blend weights: give one weight per dataset.")
        self.datasets = list(datasets)
        self.which = blend_indices(weights, num_samples)
        self.within = np.zeros(num_samples, dtype=np.int64)
        seen = np.zeros(len(datasets), dtype=np.int64)
        for i, k in enumerate(self.which):
            self.within[i] = seen[k] % len(self.datasets[k])
            seen[k] += 1

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.datasets[int(self.which[i])][int(self.within[i])]
