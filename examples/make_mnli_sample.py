"""Write the small synthetic MNLI-format sample shipped in ``lightning_megatron/recipes/data/sample/``.

It exists so the first recipe runs anywhere in about a minute; it is NOT MultiNLI. Each templated
premise gets one hypothesis per label, like MultiNLI's prompts: entailment drops detail,
contradiction negates or moves the event, neutral adds what the premise does not say. Train and
matched dev share their genres' words; mismatched dev uses other genres with other words, and the
same kinds of reasoning. Deterministic for a given ``--seed``.

    python examples/make_mnli_sample.py            # rewrites the shipped sample
    python examples/make_mnli_sample.py --out /tmp/sample --train-premises 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Dict, List, Sequence, Tuple

MATCHED = {
    "fiction": dict(
        subj=["farmer", "sailor", "princess", "wizard", "knight", "baker", "hunter", "painter"],
        obj=["letter", "lamp", "basket", "sword", "map", "bread", "key", "boat"],
        place=["castle", "forest", "village", "harbor", "tower", "cottage", "market", "garden"]),
    "travel": dict(
        subj=["tourist", "guide", "pilot", "driver", "traveler", "photographer"],
        obj=["ticket", "suitcase", "camera", "passport", "guidebook", "backpack"],
        place=["airport", "museum", "station", "hotel", "beach", "temple"]),
    "government": dict(
        subj=["senator", "official", "mayor", "committee", "clerk", "governor", "minister"],
        obj=["report", "budget", "law", "proposal", "contract", "memo"],
        place=["capital", "office", "parliament", "courthouse", "embassy", "ministry"]),
}
MISMATCHED = {
    "letters": dict(
        subj=["editor", "reader", "writer", "donor", "volunteer"],
        obj=["check", "newsletter", "donation", "envelope", "form"],
        place=["library", "school", "church", "center", "foundation"]),
    "face-to-face": dict(
        subj=["neighbor", "teacher", "nurse", "coach", "student", "grandmother"],
        obj=["car", "dog", "book", "phone", "bicycle", "guitar"],
        place=["kitchen", "yard", "hospital", "gym", "classroom", "park"]),
}
ADJECTIVES = ["old", "young", "tired", "brave", "quiet", "clever", "busy", "careful"]
VERBS = [("found", "find"), ("carried", "carry"), ("cleaned", "clean"), ("opened", "open"), ("sold", "sell"),
         ("painted", "paint"), ("hid", "hide"), ("bought", "buy"), ("repaired", "repair"), ("moved", "move")]
REASONS = ["broken", "expensive", "a gift", "very old", "needed urgently", "too heavy"]
FOR_WHOM = ["a friend", "the family", "a stranger", "the children", "a colleague"]
LATER = ["tomorrow", "next week", "next year", "on monday"]

PREMISES = [
    "The {adj} {subj} {past} the {obj} in the {place}.",
    "In the {place}, the {adj} {subj} {past} the {obj}.",
    "Early in the morning, the {adj} {subj} {past} the {obj} in the {place}.",
]
HYPOTHESES = {
    "entailment": [
        "The {subj} {past} the {obj}.",
        "Someone {past} the {obj} in the {place}.",
        "The {subj} was in the {place}.",
        "A {subj} {past} something.",
    ],
    "contradiction": [
        "The {subj} did not {base} the {obj}.",
        "The {subj} {past} the {obj} in the {other_place}.",
        "Nobody {past} anything in the {place}.",
        "The {subj} never went to the {place}.",
    ],
    "neutral": [
        "The {subj} {past} the {obj} because it was {reason}.",
        "The {subj} {past} the {obj} for {for_whom}.",
        "The {subj} will {base} another {obj} {later}.",
        "The {subj} {past} the {obj} in the {place} with a friend.",
    ],
}
LABELS = ("entailment", "neutral", "contradiction")

HEADER_TRAIN = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
HEADER_DEV = HEADER_TRAIN[:11] + ["label2", "label3", "label4", "label5", "gold_label"]


def _words(text: str) -> List[str]:
    return re.findall(r"\w+|[^\w\s]", text.lower())


def _binary_parse(text: str) -> str:
    return "( " + " ".join(_words(text)) + " )"


def _parse(text: str) -> str:
    return "(ROOT " + " ".join(f"(X {w})" for w in _words(text)) + ")"


def _premise_slots(rng: random.Random, genre: Dict[str, List[str]]) -> Dict[str, str]:
    past, base = rng.choice(VERBS)
    place, other_place = rng.sample(genre["place"], 2)
    return dict(adj=rng.choice(ADJECTIVES), subj=rng.choice(genre["subj"]), obj=rng.choice(genre["obj"]),
                place=place, other_place=other_place, past=past, base=base, reason=rng.choice(REASONS),
                for_whom=rng.choice(FOR_WHOM), later=rng.choice(LATER))


def make_split(rng: random.Random, genres: Dict[str, dict], premises: int, seen: set) -> List[Tuple[str, ...]]:
    """``premises`` new premises (not in ``seen``), each with an entailed, a neutral and a contradicting
    hypothesis: rows of (promptID, genre, premise, hypothesis, label)."""
    rows = []
    names = sorted(genres)
    while len(rows) < 3 * premises:
        genre = names[len(rows) // 3 % len(names)]
        slots = _premise_slots(rng, genres[genre])
        premise = rng.choice(PREMISES).format(**slots)
        if premise in seen:
            continue
        seen.add(premise)
        prompt = str(len(seen))
        for label in LABELS:
            hypothesis = rng.choice(HYPOTHESES[label]).format(**slots)
            rows.append((prompt, genre, premise, hypothesis, label))
    return rows


def write_tsv(path: str, rows: Sequence[Tuple[str, ...]], header: List[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\t".join(header) + "\n")
        for index, (prompt, genre, premise, hypothesis, label) in enumerate(rows):
            labels = [label] * (len(header) - 10)   # label1 [.. label5] and gold_label
            fields = [str(index), prompt, prompt + label[0], genre, _binary_parse(premise), _binary_parse(hypothesis),
                      _parse(premise), _parse(hypothesis), premise, hypothesis, *labels]
            f.write("\t".join(fields) + "\n")


def write_vocab(path: str, texts: Sequence[str]) -> None:
    """A WordPiece vocabulary covering every word of the sample, for the randomly initialized model."""
    words = sorted({w for text in texts for w in _words(text)})
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    tokens += [c for c in chars if c not in words] + ["##" + c for c in chars]
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(tokens) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "lightning_megatron", "data", "sample"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-premises", type=int, default=200, help="3 rows each")
    parser.add_argument("--dev-premises", type=int, default=34, help="3 rows each, per dev file")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seen: set = set()
    train = make_split(rng, MATCHED, args.train_premises, seen)
    matched = make_split(rng, MATCHED, args.dev_premises, seen)
    mismatched = make_split(rng, MISMATCHED, args.dev_premises, seen)
    os.makedirs(args.out, exist_ok=True)
    write_tsv(os.path.join(args.out, "train.tsv"), train, HEADER_TRAIN)
    write_tsv(os.path.join(args.out, "dev_matched.tsv"), matched, HEADER_DEV)
    write_tsv(os.path.join(args.out, "dev_mismatched.tsv"), mismatched, HEADER_DEV)
    write_vocab(os.path.join(args.out, "vocab.txt"), [r[2] + " " + r[3] for r in train + matched + mismatched])
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"do_lower_case": True}, f)
        f.write("\n")
    print(f"wrote {len(train)} train, {len(matched)} dev_matched, {len(mismatched)} dev_mismatched rows "
          f"to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
