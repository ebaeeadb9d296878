"""The on-disk corpus: every document's token ids back to back, and where each document starts.

``PREFIX.bin`` holds the ids (uint16 when the vocabulary fits, else int32), ``PREFIX.idx.npy`` the
``num_documents + 1`` start offsets, ``PREFIX.json`` what made it (tokenizer, end-of-document id).
Readers memory-map the ids: a rank touches only the pages of the samples it reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Sequence, Union

import numpy as np

PathLike = Union[str, Path]


def _paths(prefix: PathLike) -> Dict[str, Path]:
    prefix = str(prefix)
    return {"bin": Path(prefix + ".bin"), "idx": Path(prefix + ".idx.npy"), "meta": Path(prefix + ".json")}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def write_token_file(prefix: PathLike, documents: Iterable[Union[Sequence[int], np.ndarray]], vocab_size: int,
                     metadata: Optional[Dict[str, Any]] = None) -> "TokenFile":
    """Write ``documents`` (lists of ids, each ending with its end-of-document id if wanted)."""
    paths = _paths(prefix)
    paths["bin"].parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    offsets = [0]
    with open(paths["bin"], "wb") as out:
        for doc in documents:
            ids = np.asarray(doc, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} is outside the "
                                 f"vocabulary (vocab_size={vocab_size}).")
            out.write(ids.astype(dtype).tobytes())
            offsets.append(offsets[-1] + ids.size)
    np.save(paths["idx"], np.asarray(offsets, dtype=np.int64))
    meta = {"vocab_size": vocab_size, "dtype": dtype.name, "num_documents": len(offsets) - 1,
            "num_tokens": offsets[-1], **(metadata or {})}
    paths["meta"].write_text(json.dumps(meta, indent=1))
    return TokenFile(prefix)


class TokenFile:
    """A read-only, memory-mapped token file (see the module docstring)."""

    def __init__(self, prefix: PathLike) -> None:
        paths = _paths(prefix)
        missing = [str(p) for p in paths.values() if not p.exists()]
        if missing:
            raise FileNotFoundError(
                f"no token file at prefix {str(prefix)!r} (missing {', '.join(missing)}); make one with "
                f"`python -m lightning_megatron.recipes.corpus.preprocess --input TEXT_FILES --tokenizer DIR "
                f"--output-prefix {prefix}`.")
        self.prefix = str(prefix)
        self.meta: Dict[str, Any] = json.loads(paths["meta"].read_text())
        self.offsets: np.ndarray = np.load(paths["idx"])
        self.vocab_size: int = int(self.meta["vocab_size"])
        size = int(self.offsets[-1])
        self.tokens: np.ndarray = (np.memmap(paths["bin"], dtype=np.dtype(self.meta["dtype"]), mode="r", shape=(size,))
                                   if size else np.zeros(0, dtype=np.dtype(self.meta["dtype"])))

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])
