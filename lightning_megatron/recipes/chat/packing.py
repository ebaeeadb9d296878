"""Tokenized conversations packed into fixed-length rows, each one a document of its row.

A row of ``seq_length`` tokens holds whole conversations back to back (best fit in a seeded shuffled order);
``position_ids`` restart at 0 in each, ``document_ids`` number them (-1 on padding) so attention stays inside
each conversation, and a token's label is the next token of its own conversation when the assistant wrote
that token, else ``ignore_index``. Rows then hold different numbers of labelled tokens: train with
``MegatronStrategy(calculate_per_token_loss=True)`` so every assistant token weighs the same.

A conversation longer than ``seq_length`` is cut to its first ``seq_length`` tokens (``overlong="truncate"``)
or left out (``"drop"``); either is counted in :class:`PackingStats`, as are conversations left without a
trained token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

OVERLONG = ("truncate", "drop")
Encoded = Tuple[Sequence[int], Sequence[int]]   # (token ids, assistant mask)


@dataclass
class PackingStats:
    conversations: int = 0        # read
    truncated: int = 0            # longer than seq_length, cut (overlong="truncate")
    dropped_overlong: int = 0     # longer than seq_length, left out (overlong="drop")
    dropped_untrained: int = 0    # no assistant token left to predict (after truncation)
    trained_tokens: int = 0       # labels that are not ignore_index
    rows: int = 0
    fill: float = 0.0             # share of row positions holding a conversation's token

    def describe(self) -> str:
        return (f"{self.conversations} conversations, {self.truncated} truncated to seq_length, "
                f"{self.dropped_overlong} dropped as longer than seq_length, {self.dropped_untrained} dropped with "
                f"no assistant token to train; {self.trained_tokens} assistant tokens trained, packed into "
                f"{self.rows} rows ({self.fill:.0%} filled)")


def fit_to_length(encoded: Sequence[Encoded], seq_length: int, overlong: str,
                  stats: PackingStats) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The conversations that go into rows, as arrays, truncated or dropped by ``overlong``; counts in ``stats``."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r} is not one of {list(OVERLONG)}.")
    kept = []
    for ids, mask in encoded:
        stats.conversations += 1
        if len(ids) > seq_length:
            if overlong == "drop":
                stats.dropped_overlong += 1
                continue
            stats.truncated += 1
            ids, mask = ids[:seq_length], mask[:seq_length]
        trained = int(np.sum(np.asarray(mask[1:], dtype=np.int64)))   # the first token is never a label
        if trained == 0:
            stats.dropped_untrained += 1
            continue
        stats.trained_tokens += trained
        kept.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
    return kept


def best_fit(lengths: Sequence[int], capacity: int, seed: int) -> List[List[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity``: each, in a seeded shuffled order, into the
    open row with the least room that holds it (O(log rows) each)."""
    rows: List[List[int]] = []
    rooms: List[int] = []                  # the distinct free room sizes of open rows, sorted
    open_rows: Dict[int, List[int]] = {}   # free room -> the rows with that much room
    for i in np.random.default_rng(seed).permutation(len(lengths)):
        length = int(lengths[i])
        if not 0 < length <= capacity:
            raise ValueError(f"item {int(i)} has length {length}, outside 1..{capacity}.")
        k = bisect.bisect_left(rooms, length)
        if k < len(rooms):
            room = rooms[k]
            r = open_rows[room].pop()
            if not open_rows[room]:
                del open_rows[room], rooms[k]
            rows[r].append(int(i))
        else:
            room, r = capacity, len(rows)
            rows.append([int(i)])
        left = room - length
        if left > 0:
            if left not in open_rows:
                open_rows[left] = []
                bisect.insort(rooms, left)
            open_rows[left].append(r)
    return rows


class PackedConversations(Dataset):
    """Rows of ``seq_length`` tokens (module doc). Item: ``input_ids``, ``labels``, ``position_ids``,
    ``document_ids``, each ``[seq_length]``."""

    def __init__(self, conversations: Sequence[Tuple[np.ndarray, np.ndarray]], seq_length: int, seed: int = 0,
                 pad_id: int = 0, ignore_index: int = -100) -> None:
        self.conversations, self.seq_length = list(conversations), seq_length
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.rows = best_fit([len(ids) for ids, _ in self.conversations], seq_length, seed)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fill(self) -> float:
        used = sum(len(ids) for ids, _ in self.conversations)
        return used / max(1, len(self.rows) * self.seq_length)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.ignore_index, dtype=np.int64)
        positions = np.zeros(s, dtype=np.int64)
        documents = np.full(s, -1, dtype=np.int64)
        at = 0
        for k, c in enumerate(self.rows[i]):
            ids, mask = self.conversations[c]
            n = len(ids)
            tokens[at:at + n] = ids
            # position t predicts token t + 1 of the same conversation, trained where the assistant wrote it
            labels[at:at + n - 1] = np.where(mask[1:], ids[1:], self.ignore_index)
            positions[at:at + n] = np.arange(n)
            documents[at:at + n] = k
            at += n
        return {"input_ids": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(documents)}
