"""Tokenized MNLI and RACE datasets and the collate function that pads a batch.

Samples are dicts ``input_ids``, ``token_type_ids``, ``attention_mask`` (1 = token) and ``labels``;
RACE adds a choices axis (``[b, 4, s]``). Batches are padded to their longest sequence rounded up
to ``pad_to_multiple_of`` (sequence parallelism splits the sequence across tensor-parallel ranks;
tensor-parallel peers read the same samples, so they pad alike).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, TypedDict

import numpy as np
import torch
from torch.utils.data import Dataset

from .encoding import build_pair, longest_first, race_query
from .mnli import MNLIExample
from .race import NUM_CHOICES, RaceQuestion
from .tokenizer import WordPieceTokenizer

IGNORE_LABEL = -100   # unlabeled rows (MNLI test files)



class Sample(TypedDict):
    """One example: its sequences (one pair for MNLI, one per choice for RACE), the length of each one's
    first segment (``[CLS] a [SEP]``) and the label."""

    sequences: List[np.ndarray]
    first_lengths: List[int]
    label: int


def _check_length(max_length: int, least: int, name: str = "max_seq_length") -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {max_length!r}.")


class MNLIDataset(Dataset):
    """Premise/hypothesis pairs as ``[CLS] premise [SEP] hypothesis [SEP]``, at most ``max_length``."""

    def __init__(self, examples: Sequence[MNLIExample], tokenizer: WordPieceTokenizer, max_length: int = 128) -> None:
        _check_length(max_length, 4)
        premises = tokenizer.encode_batch([e.premise for e in examples])
        hypotheses = tokenizer.encode_batch([e.hypothesis for e in examples])
        self.sequences: List[np.ndarray] = []
        self.first_lengths: List[int] = []
        for a, b in zip(premises, hypotheses):
            keep_a, keep_b = longest_first(len(a), len(b), max_length - 3)
            ids, first = build_pair(a[:keep_a], b[:keep_b], tokenizer.cls_id, tokenizer.sep_id)
            self.sequences.append(np.asarray(ids, dtype=np.int32))
            self.first_lengths.append(first)
        self.labels = [IGNORE_LABEL if e.label is None else e.label for e in examples]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> Sample:
        return {"sequences": [self.sequences[i]], "first_lengths": [self.first_lengths[i]], "label": self.labels[i]}


class RaceDataset(Dataset):
    """Each question as four ``[CLS] article [SEP] question+option [SEP]`` sequences.

    Articles are tokenized once and stored once; sequences are put together when read, so memory
    grows with the passages, not with four copies per question.
    """

    def __init__(self, questions: Sequence[RaceQuestion], tokenizer: WordPieceTokenizer, max_length: int = 512,
                 max_qa_length: int = 128) -> None:
        _check_length(max_length, 8)
        if isinstance(max_qa_length, bool) or not isinstance(max_qa_length, int) or \
                not 1 <= max_qa_length <= max_length - 4:
            raise ValueError(f"max_qa_length must be an integer in [1, max_seq_length - 4 = {max_length - 4}] so "
                             f"that some of the article fits, got {max_qa_length!r}.")
        self.max_length, self.max_qa_length = max_length, max_qa_length
        self.cls_id, self.sep_id = tokenizer.cls_id, tokenizer.sep_id
        index: Dict[str, int] = {}
        for q in questions:
            index.setdefault(q.article, len(index))
        self.articles = [np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch(list(index))]
        self.article_of = [index[q.article] for q in questions]
        queries = tokenizer.encode_batch([race_query(q.question, o) for q in questions for o in q.options])
        self.queries = [np.asarray(ids[:max_qa_length], dtype=np.int32) for ids in queries]
        self.labels = [q.label for q in questions]
        self.levels = [q.level for q in questions]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Sample:
        article = self.articles[self.article_of[i]]
        cls, sep = np.array([self.cls_id], np.int32), np.array([self.sep_id], np.int32)
        sequences, firsts = [], []
        for query in self.queries[NUM_CHOICES * i:NUM_CHOICES * (i + 1)]:
            kept = article[:self.max_length - 3 - len(query)]      # the article gives way, never the query
            sequences.append(np.concatenate([cls, kept, sep, query, sep]))
            firsts.append(len(kept) + 2)
        return {"sequences": sequences, "first_lengths": firsts, "label": self.labels[i]}


class PadCollate:
    """Samples → a batch of tensors; ``choices=True`` keeps the per-sample sequences as an axis."""

    def __init__(self, pad_id: int, choices: bool = False, pad_to_multiple_of: int = 8) -> None:
        if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}.")
        self.pad_id, self.choices, self.multiple = pad_id, choices, pad_to_multiple_of

    def __call__(self, samples: List[Sample]) -> Dict[str, torch.Tensor]:
        longest = max(len(s) for sample in samples for s in sample["sequences"])
        length = -(-longest // self.multiple) * self.multiple
        per = len(samples[0]["sequences"])
        ids = torch.full((len(samples), per, length), self.pad_id, dtype=torch.long)
        types = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for b, sample in enumerate(samples):
            for c, (seq, first) in enumerate(zip(sample["sequences"], sample["first_lengths"])):
                n = len(seq)
                ids[b, c, :n] = torch.from_numpy(seq.astype(np.int64))
                types[b, c, first:n] = 1
                mask[b, c, :n] = 1
        if not self.choices:
            ids, types, mask = ids[:, 0], types[:, 0], mask[:, 0]
        labels = torch.tensor([s["label"] for s in samples], dtype=torch.long)
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels}
