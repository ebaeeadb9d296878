"""BERT WordPiece tokenization from a ``vocab.txt``, with the ``tokenizers`` library.

Built from the same pieces as Hugging Face's BERT tokenizer (BERT normalizer, BERT
pre-tokenizer, WordPiece with ``[UNK]`` and 100-character words), so the ids match
``transformers.AutoTokenizer`` on the same directory. Special tokens are added by the encoders in
``features.py``, which also own truncation.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _vocab_looks_uncased(vocab_file: str) -> bool:
    """A cased BERT vocabulary holds capitalised whole words ('The'); an uncased one does not."""
    with open(vocab_file, encoding="utf-8") as f:
        words = [line.rstrip("\n") for line in f]
    capitalised = sum(1 for w in words if w[:1].isupper() and not w.startswith("["))
    return capitalised < max(1, len(words) // 100)


def resolve_lowercase(directory: str, vocab_file: str, lowercase: Optional[bool] = None) -> bool:
    """``lowercase`` if given, else ``do_lower_case`` from tokenizer_config.json or config.json,
    else whether the vocabulary has no capitalised words."""
    if lowercase is not None:
        return lowercase
    for name in ("tokenizer_config.json", "config.json"):
        value = _read_json(os.path.join(directory, name)).get("do_lower_case")
        if value is not None:
            return bool(value)
    return _vocab_looks_uncased(vocab_file)


class WordPieceTokenizer:
    """Text → WordPiece ids (no special tokens); ``cls_id``/``sep_id``/``pad_id`` for the encoders.

    ``path`` is a model directory holding ``vocab.txt`` (and optionally ``tokenizer_config.json``
    with ``do_lower_case``) or a ``vocab.txt`` file.
    """

    def __init__(self, path: str, lowercase: Optional[bool] = None) -> None:
        try:
            from tokenizers import Tokenizer, normalizers, pre_tokenizers
            from tokenizers.models import WordPiece
        except ImportError as e:
            raise ImportError("WordPieceTokenizer needs the 'tokenizers' library: pip install tokenizers "
                              "(or pip install 'lightning-megatron[hf]').") from e

        path = os.fspath(path)
        vocab_file = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"tokenizer: {vocab_file} not found; pass a BERT model directory holding "
                                    "vocab.txt, or the vocab.txt file itself.")
        directory = os.path.dirname(vocab_file)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        self.lowercase = resolve_lowercase(directory, vocab_file, lowercase)
        self.vocab = WordPiece.read_file(vocab_file)
        missing = [t for t in SPECIAL_TOKENS if t not in self.vocab]
        if missing:
            raise ValueError(f"tokenizer: {vocab_file} lacks the BERT special token(s) {missing}.")
        tok = Tokenizer(WordPiece(self.vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
            strip_accents=config.get("strip_accents"), lowercase=self.lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tokenizer = tok
        self.vocab_file = vocab_file
        self.vocab_size = len(self.vocab)
        self.cls_id, self.sep_id, self.pad_id = (self.vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]"))

    def encode(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Many texts at once (the Rust side runs them in parallel)."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]
