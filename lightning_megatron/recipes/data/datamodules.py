"""LightningDataModules for MNLI and RACE: read the official files, tokenize, batch.

``batch_size`` is per data-parallel rank (the global batch is ``batch_size × dp ×
accumulate_grad_batches``); tensor-, pipeline- and context-parallel peers read the same batches
(the megatron strategy hands Lightning the data-parallel rank for its sampler). Every rank reads
and tokenizes the files itself in ``setup``.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from .datasets import MNLIDataset, PadCollate, RaceDataset
from .mnli import find_mnli_files, read_mnli
from .race import RACE_LEVELS, read_race
from .sources import SAMPLE_DIR, resolve_tokenizer_path
from .tokenizer import WordPieceTokenizer


class _TaskDataModule(L.LightningDataModule):
    """Tokenizer, loaders and checks shared by the task datamodules."""

    choices = False

    def __init__(self, tokenizer: Optional[str], batch_size: int, eval_batch_size: Optional[int], max_seq_length: int,
                 pad_to_multiple_of: int, num_workers: int, lowercase: Optional[bool]) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("max_seq_length", max_seq_length),
                            ("pad_to_multiple_of", pad_to_multiple_of)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if max_seq_length % pad_to_multiple_of:
            raise ValueError(f"max_seq_length={max_seq_length} is not a multiple of pad_to_multiple_of="
                             f"{pad_to_multiple_of}; padded batches would exceed it. Make it a multiple.")
        self.tokenizer_path = resolve_tokenizer_path(tokenizer)
        self.lowercase = lowercase
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.max_seq_length, self.pad_to_multiple_of, self.num_workers = max_seq_length, pad_to_multiple_of, num_workers
        self.tokenizer: Optional[WordPieceTokenizer] = None

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary (a randomly initialized model takes its embedding size from it)."""
        return self._tokenizer().vocab_size

    def _tokenizer(self) -> WordPieceTokenizer:
        if self.tokenizer is None:
            self.tokenizer = WordPieceTokenizer(self.tokenizer_path, self.lowercase)
        return self.tokenizer

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        collate = PadCollate(self._tokenizer().pad_id, choices=self.choices, pad_to_multiple_of=self.pad_to_multiple_of)
        # Training drops the ragged last batch (micro-batching needs equal batches); evaluation keeps every row.
        return DataLoader(dataset, batch_size=self.batch_size if train else self.eval_batch_size, shuffle=train,
                          drop_last=train, collate_fn=collate, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)


class MNLIDataModule(_TaskDataModule):
    """MultiNLI: trains on ``train``; validates on ``dev_matched`` (dataloader 0) and
    ``dev_mismatched`` (dataloader 1).

    Args:
        data_dir: GLUE's MNLI folder (``train.tsv``, ``dev_matched.tsv``, ``dev_mismatched.tsv``) or
            MultiNLI 1.0's (``multinli_1.0_*.jsonl``). ``None``: the small synthetic sample shipped in
            the package (a smoke test, not MultiNLI).
        tokenizer: the pretrained model's directory (its ``vocab.txt``), ``"minilm"``,
            ``"minilm-if-installed"`` (the sample's vocabulary when MiniLM is not installed), or ``None``:
            the shipped sample's own vocabulary (for a randomly initialized model on the sample).
        skip_no_consensus: leave out pairs whose gold label is ``-`` (no annotator majority), as the
            official evaluation does; ``False`` makes them an error. The count is reported.
        max_seq_length: ``[CLS] premise [SEP] hypothesis [SEP]`` is cut to this many tokens, the
            longer sentence first.
        lowercase: ``None`` follows the tokenizer's ``do_lower_case``.
    """

    def __init__(self, data_dir: Optional[str] = None, tokenizer: Optional[str] = "minilm-if-installed",
                 batch_size: int = 32,
                 eval_batch_size: Optional[int] = None, max_seq_length: int = 128, skip_no_consensus: bool = True,
                 pad_to_multiple_of: int = 8, num_workers: int = 0, lowercase: Optional[bool] = None) -> None:
        super().__init__(tokenizer, batch_size, eval_batch_size, max_seq_length, pad_to_multiple_of, num_workers,
                         lowercase)
        self.save_hyperparameters()
        self.data_dir = SAMPLE_DIR if data_dir is None else os.path.expanduser(data_dir)
        self.skip_no_consensus = skip_no_consensus
        self.datasets: Dict[str, MNLIDataset] = {}

    def setup(self, stage: Optional[str] = None) -> None:
        files = find_mnli_files(self.data_dir)
        wanted = [s for s in files if stage != "validate" or s != "train"]
        for split in wanted:
            if split in self.datasets:
                continue
            # every split is trained or validated on: a file without labels would count for nothing
            read = read_mnli(files[split], skip_no_consensus=self.skip_no_consensus, require_labels=True)
            if read.skipped_lines:
                rank_zero_info(f"MNLI {os.path.basename(files[split])}: left out {len(read.skipped_lines)} pairs "
                               "whose gold label is '-' (no annotator majority), as the official evaluation does.")
            self.datasets[split] = MNLIDataset(read.examples, self._tokenizer(), self.max_seq_length)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.datasets["train"], train=True)

    def val_dataloader(self) -> List[DataLoader]:
        return [self._loader(self.datasets[s], train=False) for s in ("dev_matched", "dev_mismatched")]


class RaceDataModule(_TaskDataModule):
    """RACE: trains on ``train`` (middle + high); validates on ``eval_split`` middle (dataloader 0)
    and high (dataloader 1).

    Args:
        data_dir: the RACE folder (``train/``, ``dev/``, ``test/``, each with ``middle/`` and ``high/``).
        tokenizer: the pretrained model's directory (its ``vocab.txt``) or ``"minilm"``.
        eval_split: ``"dev"`` to select checkpoints, ``"test"`` for the number the paper reports.
        max_seq_length: each ``[CLS] article [SEP] question+option [SEP]`` is cut to this many
            tokens, from the article's end; the question+option keeps up to ``max_qa_length``.
        lowercase: ``None`` follows the tokenizer's ``do_lower_case``.
    """

    choices = True

    def __init__(self, data_dir: str, tokenizer: str, batch_size: int = 32, eval_batch_size: Optional[int] = None,
                 max_seq_length: int = 512, max_qa_length: int = 128, eval_split: str = "dev",
                 pad_to_multiple_of: int = 8, num_workers: int = 0, lowercase: Optional[bool] = None) -> None:
        super().__init__(tokenizer, batch_size, eval_batch_size, max_seq_length, pad_to_multiple_of, num_workers,
                         lowercase)
        if eval_split not in ("dev", "test"):
            raise ValueError(f"eval_split={eval_split!r} must be 'dev' or 'test'.")
        if not 1 <= max_qa_length <= max_seq_length - 4:
            raise ValueError(f"max_qa_length={max_qa_length} must be in [1, max_seq_length - 4 = "
                             f"{max_seq_length - 4}] so that some of the article fits.")
        self.save_hyperparameters()
        self.data_dir = os.path.expanduser(data_dir)
        self.max_qa_length, self.eval_split = max_qa_length, eval_split
        self.datasets: Dict[str, RaceDataset] = {}

    def _dataset(self, questions: list) -> RaceDataset:
        return RaceDataset(questions, self._tokenizer(), self.max_seq_length, self.max_qa_length)

    def setup(self, stage: Optional[str] = None) -> None:
        if stage != "validate" and "train" not in self.datasets:
            train = read_race(self.data_dir, "train")
            self.datasets["train"] = self._dataset([q for level in RACE_LEVELS for q in train[level]])
        if not all(level in self.datasets for level in RACE_LEVELS):
            for level, questions in read_race(self.data_dir, self.eval_split).items():
                self.datasets[level] = self._dataset(questions)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.datasets["train"], train=True)

    def val_dataloader(self) -> List[DataLoader]:
        return [self._loader(self.datasets[level], train=False) for level in RACE_LEVELS]
