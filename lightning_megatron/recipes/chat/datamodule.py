"""``ChatData``: JSONL conversations through the tokenizer's chat template into packed training rows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from ..data.errors import DataFormatError
from .conversations import read_conversations
from .packing import OVERLONG, PackedConversations, PackingStats, fit_to_length
from .template import METHODS, encode_conversation, load_chat_tokenizer

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict

IGNORE_INDEX = -100


class ChatData(L.LightningDataModule):
    """Conversations of ``train_files`` (and ``valid_files``), JSONL, one conversation a line
    (``recipes.chat.conversations``), formatted by the chat template of the ``tokenizer`` folder, trained on the
    assistant's tokens only, packed ``seq_length`` tokens a row (``recipes.chat.packing``).

    Args:
        overlong: a conversation longer than ``seq_length``: ``"truncate"`` keeps its first ``seq_length`` tokens,
            ``"drop"`` leaves it out. Both are counted and logged at setup (rank 0), with the conversations that
            are left without an assistant token.
        assistant_mask: how the assistant's tokens are found: ``"auto"``, ``"generation"`` (the template's
            ``{% generation %}`` marks) or ``"prefix"`` (rendered prefixes; ``recipes.chat.template``).
        batch_size: rows per data-parallel rank and step, as for any loader under the megatron strategy.
        sample: a folder; when the files are missing there, write the project's tiny chat sample into it (a random
            Llama with a chat-template tokenizer in ``SAMPLE/model``, ``SAMPLE/train.jsonl``, ``SAMPLE/valid.jsonl``).
    """

    if TYPE_CHECKING:   # what save_hyperparameters() stores: keys read as attributes (Lightning types it loosely)
        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(self, train_files: List[str], tokenizer: str, valid_files: Optional[List[str]] = None,
                 seq_length: int = 1024, batch_size: int = 8, overlong: str = "truncate",
                 assistant_mask: str = "auto", seed: int = 1234, num_workers: int = 0,
                 sample: Optional[str] = None) -> None:
        super().__init__()
        if not train_files:
            raise ValueError("ChatData(train_files=...) needs at least one JSONL file.")
        if overlong not in OVERLONG:
            raise ValueError(f"ChatData(overlong={overlong!r}) must be one of {list(OVERLONG)}.")
        if assistant_mask not in METHODS:
            raise ValueError(f"ChatData(assistant_mask={assistant_mask!r}) must be one of {list(METHODS)}.")
        for name, value in (("seq_length", seq_length), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChatData({name}={value!r}) must be a positive integer.")
        self.save_hyperparameters()
        self.tokenizer: Any = None
        self.stats: Dict[str, PackingStats] = {}
        self._sets: Dict[str, PackedConversations] = {}

    def prepare_data(self) -> None:
        h = self.hparams
        files = list(h.train_files) + list(h.valid_files or []) + [str(Path(h.tokenizer) / "tokenizer_config.json")]
        if h.sample is not None and not all(Path(f).exists() for f in files):
            from .sample import write_chat_sample

            write_chat_sample(Path(h.sample))

    def setup(self, stage: str) -> None:
        h = self.hparams
        if self.tokenizer is None:
            self.tokenizer = load_chat_tokenizer(h.tokenizer)
        if stage == "fit" and "train" not in self._sets:
            self._sets["train"] = self._packed("train", list(h.train_files), h.seed)
        if stage in ("fit", "validate") and "valid" not in self._sets and h.valid_files:
            self._sets["valid"] = self._packed("valid", list(h.valid_files), h.seed + 1)

    @property
    def pad_id(self) -> int:
        for token_id in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if token_id is not None:
                return int(token_id)
        return 0

    def encode(self, files: List[str]) -> List[tuple]:
        """(ids, assistant mask) of every conversation of ``files``; an error names the file and line."""
        out = []
        for file in files:
            for conversation in read_conversations(file):
                try:
                    out.append(encode_conversation(self.tokenizer, conversation.messages, self.hparams.assistant_mask))
                except ValueError as err:
                    raise DataFormatError(conversation.path, conversation.line, str(err)) from err
        return out

    def _packed(self, split: str, files: List[str], seed: int) -> PackedConversations:
        h = self.hparams
        stats = PackingStats()
        kept = fit_to_length(self.encode(files), h.seq_length, h.overlong, stats)
        if not kept:
            raise ValueError(f"no {split} conversation is left to train on ({stats.describe()}).")
        packed = PackedConversations(kept, h.seq_length, seed=seed, pad_id=self.pad_id, ignore_index=IGNORE_INDEX)
        stats.rows, stats.fill = len(packed), packed.fill
        self.stats[split] = stats
        rank_zero_info(f"chat data ({split}, {', '.join(files)}): {stats.describe()}")
        return packed

    def _loader(self, split: str, drop_last: bool) -> DataLoader:
        return DataLoader(self._sets[split], batch_size=self.hparams.batch_size, shuffle=split == "train",
                          drop_last=drop_last, num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        replicas = (kwargs or {}).get("num_replicas", 1)
        rows = len(self._sets["train"])
        if rows < self.hparams.batch_size * replicas:
            raise ValueError(f"the training conversations pack into {rows} rows of {self.hparams.seq_length} tokens, "
                             f"fewer than one batch ({self.hparams.batch_size} rows x {replicas} data-parallel ranks)"
                             "; use more conversations or a smaller batch_size.")
        return self._loader("train", drop_last=True)

    def val_dataloader(self) -> Union[DataLoader, List[DataLoader]]:
        # every validation row counts (the last batch may be smaller), so val_loss is the whole set's token mean
        return self._loader("valid", drop_last=False) if "valid" in self._sets else []
