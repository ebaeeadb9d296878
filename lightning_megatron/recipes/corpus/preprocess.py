"""Tokenize text files into one token file, in parallel over files.

    python -m lightning_megatron.recipes.corpus.preprocess --input a.txt b.jsonl --tokenizer DIR \
        --output-prefix data/corpus [--workers 8] [--text-key text]

``.txt``: documents are separated by blank lines; ``.jsonl``: one document per line, its text under
``--text-key``. ``DIR`` is a local tokenizer folder (``tokenizer.json``, any BPE or SentencePiece
tokenizer ``transformers.AutoTokenizer`` reads). Each document ends with the end-of-document id
(``--eod-token``, default the tokenizer's end-of-sequence token).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple


from .token_file import TokenFile, token_dtype, write_token_file


def load_tokenizer(path: str) -> Tuple[Any, int]:
    """(``encode(text) -> ids``-capable tokenizer, vocabulary size) from a local folder or file."""
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"--tokenizer {path!r} does not exist; give a local folder holding tokenizer.json "
                                "(or a SentencePiece/Hugging Face tokenizer folder).")
    file = folder / "tokenizer.json" if folder.is_dir() else folder
    if file.name.endswith(".json") and file.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(file))
        return tok, tok.get_vocab_size(with_added_tokens=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tok, len(tok)


def eod_id(tokenizer: Any, token: Optional[str]) -> int:
    """The id that ends every document: ``token`` if given, else the tokenizer's end-of-sequence token."""
    candidates: Tuple[str, ...]
    if token is None:
        if hasattr(tokenizer, "eos_token_id") and tokenizer.eos_token_id is not None:
            return int(tokenizer.eos_token_id)
        candidates = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
    else:
        candidates = (token,)
    for name in candidates:
        found = tokenizer.token_to_id(name) if hasattr(tokenizer, "token_to_id") else tokenizer.convert_tokens_to_ids(name)
        if found is not None and (not hasattr(tokenizer, "unk_token_id") or found != tokenizer.unk_token_id):
            return int(found)
    raise ValueError(f"the tokenizer has no end-of-document token among {list(candidates)}; pass --eod-token.")


def read_documents(path: Path, text_key: str) -> Iterator[str]:
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if text_key not in record:
                        raise ValueError(f"{path}:{n} has no {text_key!r} field; pass --text-key with the text's key.")
                    yield record[text_key]
        return
    if path.suffix not in (".txt", ".text", ""):
        raise ValueError(f"{path}: only .txt (blank-line separated documents) and .jsonl files are read.")
    document: List[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                document.append(line.rstrip("\n"))
            elif document:
                yield "\n".join(document)
                document = []
    if document:
        yield "\n".join(document)


def _encode(tokenizer: Any, text: str) -> List[int]:
    if hasattr(tokenizer, "encode_batch"):   # tokenizers.Tokenizer
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _tokenize_file(job: Tuple[str, str, str, Optional[str], str]) -> Tuple[str, int]:
    """One worker: one input file into a temporary token file (merged in input order afterwards)."""
    source, tokenizer_path, prefix, eod_token, text_key = job
    tokenizer, vocab = load_tokenizer(tokenizer_path)
    end = eod_id(tokenizer, eod_token)
    docs = (_encode(tokenizer, text) + [end] for text in read_documents(Path(source), text_key))
    corpus = write_token_file(prefix, docs, vocab)
    return prefix, corpus.num_documents


def preprocess(inputs: Sequence[str], tokenizer: str, output_prefix: str, workers: int = 1,
               eod_token: Optional[str] = None, text_key: str = "text", progress: bool = True) -> TokenFile:
    """Tokenize ``inputs`` (in this order) into the token file ``output_prefix``."""
    if not inputs:
        raise ValueError("--input needs at least one text file.")
    for source in inputs:
        if not Path(source).is_file():
            raise FileNotFoundError(f"--input {source!r} is not a file.")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}.")
    _, vocab = load_tokenizer(tokenizer)
    tmp = Path(str(output_prefix) + ".parts")
    tmp.mkdir(parents=True, exist_ok=True)
    jobs = [(str(s), tokenizer, str(tmp / f"{i:05d}"), eod_token, text_key) for i, s in enumerate(inputs)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), unit="file", desc="tokenizing", file=sys.stderr)
    if workers == 1 or len(jobs) == 1:
        parts = []
        for job in jobs:
            parts.append(_tokenize_file(job))
            bar is not None and bar.update(1)
    else:
        with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            parts = []
            for part in pool.imap(_tokenize_file, jobs):   # imap keeps the input order
                parts.append(part)
                bar is not None and bar.update(1)
    if bar is not None:
        bar.close()
    pieces = [TokenFile(prefix) for prefix, _ in parts]
    meta = {"tokenizer": str(tokenizer), "eod_id": eod_id(load_tokenizer(tokenizer)[0], eod_token),
            "sources": [str(s) for s in inputs]}
    out = write_token_file(output_prefix, (p.document(i) for p in pieces for i in range(p.num_documents)), vocab, meta)
    for prefix, _ in parts:
        for suffix in (".bin", ".idx.npy", ".json"):
            Path(prefix + suffix).unlink()
    tmp.rmdir()
    assert token_dtype(vocab) == out.tokens.dtype
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.corpus.preprocess",
                                     description="Tokenize text files into a memory-mapped token file.")
    parser.add_argument("--input", nargs="+", required=True, help=".txt (blank-line separated) or .jsonl files")
    parser.add_argument("--tokenizer", required=True, help="local tokenizer folder (tokenizer.json or HF/SentencePiece)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx.npy, PREFIX.json")
    parser.add_argument("--workers", type=int, default=1, help="processes, one file each at a time")
    parser.add_argument("--eod-token", default=None, help="end-of-document token (default: the tokenizer's EOS)")
    parser.add_argument("--text-key", default="text", help="the text's key in .jsonl records")
    args = parser.parse_args(argv)
    out = preprocess(args.input, args.tokenizer, args.output_prefix, args.workers, args.eod_token, args.text_key)
    print(f"wrote {out.prefix}: {out.num_documents} documents, {out.num_tokens} tokens, vocab {out.vocab_size}")


if __name__ == "__main__":
    main()
