"""A small English-like text corpus and a byte-level BPE tokenizer trained on it, written locally.

    python -m lightning_megatron.recipes.corpus.sample OUT [--documents 2000] [--vocab-size 512]

writes ``OUT/train.txt`` and ``OUT/valid.txt`` (documents separated by blank lines) and
``OUT/tokenizer/tokenizer.json``. The text is generated from a small grammar with a fixed seed (no
download): it has the regularities a tiny model can learn in minutes, so a falling loss means the
pipeline works; it says nothing about language-model quality.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import List, Optional, Sequence

NAMES = ["Ada", "Brahms", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kofi", "Lena"]
PLACES = ["the harbor", "the library", "the old mill", "the market", "the station", "the garden", "the bridge"]
THINGS = ["a letter", "the lantern", "a map", "the key", "a basket of apples", "the violin", "a red kite"]
VERBS = ["found", "carried", "painted", "repaired", "hid", "sold", "borrowed"]
TIMES = ["in the morning", "at noon", "before the rain", "after supper", "on Sunday", "at dawn"]
MOODS = ["happy", "tired", "curious", "worried", "proud", "calm"]


def _document(rng: random.Random) -> str:
    who, other = rng.sample(NAMES, 2)
    place, thing, verb, time, mood = (rng.choice(x) for x in (PLACES, THINGS, VERBS, TIMES, MOODS))
    lines = [f"{who} went to {place} {time}.", f"There {who} {verb} {thing}.",
             f"{other} saw it and asked why.", f"{who} said that {thing} belonged to {other}.",
             f"So {who} gave {thing} to {other}, and {other} was {mood}."]
    if rng.random() < 0.5:
        lines.append(f"The next day {other} {rng.choice(VERBS)} {rng.choice(THINGS)} at {rng.choice(PLACES)[4:]}.")
    return "\n".join(lines)


def write_sample_corpus(out: Path, documents: int = 2000, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write the corpus and tokenizer under ``out``; return ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    docs: List[str] = [_document(rng) for _ in range(documents)]
    split = max(1, documents // 20)
    (out / "train.txt").write_text("\n\n".join(docs[split:]) + "\n", encoding="utf-8")
    (out / "valid.txt").write_text("\n\n".join(docs[:split]) + "\n", encoding="utf-8")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(docs, trainer=trainer)
    (out / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(out / "tokenizer" / "tokenizer.json"))
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.corpus.sample", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder to write train.txt, valid.txt and tokenizer/ into")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_sample_corpus(Path(args.out), args.documents, args.vocab_size, args.seed)
    print(f"wrote {args.out}/train.txt, valid.txt and tokenizer/tokenizer.json")


if __name__ == "__main__":
    main()
