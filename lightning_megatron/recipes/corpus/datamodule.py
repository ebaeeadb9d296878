"""``PretrainingData``: token files (one or a weighted blend) as Lightning train/validation loaders."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Union

import lightning as L
from torch.utils.data import DataLoader, Dataset

from .datasets import BlendedDataset, PackedDocuments, TokenWindows
from .token_file import TokenFile

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict


class PretrainingData(L.LightningDataModule):
    """Sequences of ``seq_length`` tokens from the token files ``train_prefixes`` (blended by
    ``train_weights``, default equal) and ``valid_prefixes``.

    Args:
        train_samples: training samples in all; default enough for ``trainer.max_steps`` optimizer steps of
            the global batch (``batch_size`` x data-parallel ranks x ``accumulate_grad_batches``).
        packed: whole documents packed per row (``position_ids`` restart per document, ``document_ids``,
            no labels across documents) instead of fixed windows across document boundaries.
        sample_corpus: a folder; when the token files are missing there, write the project's small
            sample corpus and tokenizer into it and tokenize it (``prefix`` names ``SAMPLE/train`` and
            ``SAMPLE/valid``), so a recipe runs from nothing.
        batch_size: per data-parallel rank, as for any Lightning loader under the megatron strategy.
    """

    if TYPE_CHECKING:   # what save_hyperparameters() stores: keys read as attributes (Lightning types it loosely)
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(self, train_prefixes: List[str], valid_prefixes: Optional[List[str]] = None,
                 train_weights: Optional[List[float]] = None, seq_length: int = 128, batch_size: int = 8,
                 train_samples: Optional[int] = None, valid_samples: int = 64, packed: bool = False,
                 seed: int = 1234, num_workers: int = 0, sample_corpus: Optional[str] = None) -> None:
        super().__init__()
        if not train_prefixes:
            raise ValueError("PretrainingData(train_prefixes=...) needs at least one token-file prefix.")
        if train_weights is not None and len(train_weights) != len(train_prefixes):
            raise ValueError(f"train_weights has {len(train_weights)} entries for {len(train_prefixes)} "
                             "train_prefixes: give one weight per prefix.")
        for name, value in (("seq_length", seq_length), ("batch_size", batch_size), ("valid_samples", valid_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PretrainingData({name}={value!r}) must be a positive integer.")
        self.save_hyperparameters()
        self._train: Optional[Dataset] = None
        self._valid: Optional[Dataset] = None

    def prepare_data(self) -> None:
        h = self.hparams
        if h.sample_corpus is None:
            return
        folder = Path(h.sample_corpus)
        if all(Path(p + ".bin").exists() for p in list(h.train_prefixes) + list(h.valid_prefixes or [])):
            return
        from .preprocess import preprocess
        from .sample import write_sample_corpus

        write_sample_corpus(folder)
        for split in ("train", "valid"):
            preprocess([str(folder / f"{split}.txt")], str(folder / "tokenizer"), str(folder / split), progress=False)

    def _dataset(self, prefixes: List[str], weights: Optional[List[float]], samples: int, seed: int) -> Dataset:
        h = self.hparams
        files = [TokenFile(p) for p in prefixes]
        if h.packed:
            parts: List[Dataset] = [PackedDocuments(f, h.seq_length, seed=seed + i) for i, f in enumerate(files)]
        else:
            parts = [TokenWindows(f, h.seq_length, samples, seed=seed + i) for i, f in enumerate(files)]
        if len(parts) == 1 and not h.packed:
            return parts[0]
        return BlendedDataset(parts, weights or [1.0] * len(parts), samples)

    def setup(self, stage: str) -> None:
        h = self.hparams
        if stage == "fit" and self._train is None:
            self._train = self._dataset(list(h.train_prefixes), h.train_weights, self._train_samples(), h.seed)
        if stage in ("fit", "validate") and self._valid is None and h.valid_prefixes:
            self._valid = self._dataset(list(h.valid_prefixes), None, h.valid_samples, h.seed + 1000)

    def _train_samples(self) -> int:
        h = self.hparams
        if h.train_samples is not None:
            return h.train_samples
        trainer = self.trainer
        if trainer is None or trainer.max_steps is None or trainer.max_steps < 0:
            raise ValueError("PretrainingData needs train_samples=... or a Trainer with max_steps set to size the "
                             "training set.")
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = kwargs.get("num_replicas", trainer.world_size)
        return trainer.max_steps * h.batch_size * replicas * trainer.accumulate_grad_batches

    def train_dataloader(self) -> DataLoader:
        assert self._train is not None   # setup("fit") built it
        return DataLoader(self._train, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> Union[DataLoader, List[DataLoader]]:
        if self._valid is None:
            return []
        return DataLoader(self._valid, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.hparams.num_workers)
