"""MultiNLI readers for the two official releases: GLUE's TSV files and the MultiNLI 1.0 JSONL files.

GLUE (``train.tsv``, ``dev_matched.tsv``, ``dev_mismatched.tsv``): a header row naming tab-separated
columns ``index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse
sentence2_parse sentence1 sentence2 label1 [label2 .. label5] gold_label`` (train has ``label1``
only; the test files have no label columns). Columns are found by their header name. The fields
hold quote characters, so rows are split on tabs only (no CSV quoting).

MultiNLI 1.0 (``multinli_1.0_{train,dev_matched,dev_mismatched}.jsonl``): one JSON object per line
with ``sentence1``, ``sentence2``, ``gold_label``, ``genre``, ``pairID`` (and parses we ignore).

A gold label ``-`` means the five annotators reached no majority. The official evaluation leaves
these pairs out (GLUE's TSVs have already dropped them; the JSONL dev files still hold them, ~2%).
Readers raise on them unless ``skip_no_consensus=True``, and report the skipped line numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

from .errors import DataFormatError
from .text import utf8_lines

# Class index of each label: Megatron-LM's order (tasks/glue/mnli.py).
MNLI_LABELS = ("contradiction", "entailment", "neutral")
NO_CONSENSUS = "-"

GLUE_FILES = {"train": "train.tsv", "dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv"}
JSONL_FILES = {"train": "multinli_1.0_train.jsonl", "dev_matched": "multinli_1.0_dev_matched.jsonl",
               "dev_mismatched": "multinli_1.0_dev_mismatched.jsonl"}


@dataclass(frozen=True)
class MNLIExample:
    premise: str
    hypothesis: str
    label: Optional[int]        # index into MNLI_LABELS; None in unlabeled (test) files
    genre: str = ""
    pair_id: str = ""


class MNLIFile(NamedTuple):
    examples: List[MNLIExample]
    skipped_lines: List[int]    # rows left out because their gold label was '-' (skip_no_consensus)


def read_mnli(path: str, skip_no_consensus: bool = False, require_labels: bool = False) -> MNLIFile:
    """Read a GLUE ``.tsv`` or a MultiNLI ``.jsonl`` file (chosen by the file's extension).

    ``require_labels``: raise on a TSV without a ``gold_label`` column (training and validation
    read files this way; an unlabeled file would be all ignored labels). JSONL rows always need one.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"MNLI file {path} not found; pass GLUE's MNLI folder (train.tsv, dev_matched.tsv, "
                                "dev_mismatched.tsv) or the MultiNLI 1.0 folder (multinli_1.0_*.jsonl).")
    if path.endswith(".tsv"):
        return read_mnli_tsv(path, skip_no_consensus, require_labels)
    if path.endswith(".jsonl"):
        return read_mnli_jsonl(path, skip_no_consensus)
    raise ValueError(f"{path}: unknown MNLI file type; expected GLUE's .tsv or MultiNLI's .jsonl.")


def _label(value: str, path: str, line: int, skip_no_consensus: bool) -> Optional[int]:
    """Class index of ``value``; None means 'skip this row'."""
    value = value.strip()
    if value in MNLI_LABELS:
        return MNLI_LABELS.index(value)
    if value == NO_CONSENSUS:
        if skip_no_consensus:
            return None
        raise DataFormatError(path, line, "gold_label is '-' (annotators reached no majority); pass "
                                          "skip_no_consensus=True to leave such rows out, as the official "
                                          "evaluation does.")
    raise DataFormatError(path, line, f"gold_label {value!r} is not one of {list(MNLI_LABELS)}.")


def _texts(premise: object, hypothesis: object, path: str, line: int) -> tuple:
    for name, text in (("sentence1", premise), ("sentence2", hypothesis)):
        if not isinstance(text, str) or not text.strip():
            raise DataFormatError(path, line, f"{name} is empty or not text ({text!r}).")
    assert isinstance(premise, str) and isinstance(hypothesis, str)   # checked above
    return premise.strip(), hypothesis.strip()


def _tsv_columns(header: List[str], path: str, require_labels: bool) -> dict:
    """Column index by header name; checks the columns the reader (and, if asked, training) needs."""
    missing = [c for c in ("sentence1", "sentence2") if c not in header]
    if missing:
        raise DataFormatError(path, 1, f"the header lacks column(s) {missing}; expected GLUE's MNLI header "
                                       f"(index, promptID, pairID, genre, ..., sentence1, sentence2, ..., "
                                       f"gold_label), got {header}.")
    if require_labels and "gold_label" not in header:
        raise DataFormatError(path, 1, "the header has no gold_label column, so no row has a label, but training "
                                       "and validation need labels; use GLUE's labelled train.tsv / dev_*.tsv "
                                       "(their header ends with gold_label). Unlabeled files such as "
                                       "test_matched.tsv are read with read_mnli(path) for prediction only.")
    return {name: i for i, name in enumerate(header)}


def read_mnli_tsv(path: str, skip_no_consensus: bool = False, require_labels: bool = False) -> MNLIFile:
    """GLUE's MNLI TSV; a file without a ``gold_label`` column (test) gives ``label=None``, or raises
    with ``require_labels``."""
    examples: List[MNLIExample] = []
    skipped: List[int] = []
    with open(path, "rb") as f:
        lines = utf8_lines(f, path)
        header = next(lines, (1, ""))[1].rstrip("\r\n").split("\t")
        col = _tsv_columns(header, path, require_labels)
        labelled = "gold_label" in col
        for line_no, line in lines:
            line = line.rstrip("\r\n")
            if not line.strip():
                continue    # a blank line holds no row (e.g. a trailing newline)
            row = line.split("\t")
            if len(row) != len(header):
                raise DataFormatError(path, line_no, f"expected {len(header)} tab-separated columns as in the "
                                                     f"header, found {len(row)}.")
            premise, hypothesis = _texts(row[col["sentence1"]], row[col["sentence2"]], path, line_no)
            label = None
            if labelled:
                label = _label(row[col["gold_label"]], path, line_no, skip_no_consensus)
                if label is None:
                    skipped.append(line_no)
                    continue
            examples.append(MNLIExample(premise, hypothesis, label,
                                        row[col["genre"]] if "genre" in col else "",
                                        row[col["pairID"]] if "pairID" in col else ""))
    return MNLIFile(examples, skipped)


def read_mnli_jsonl(path: str, skip_no_consensus: bool = False) -> MNLIFile:
    """MultiNLI 1.0 JSONL: ``sentence1``, ``sentence2``, ``gold_label`` per line."""
    examples: List[MNLIExample] = []
    skipped: List[int] = []
    with open(path, "rb") as f:
        for line_no, line in utf8_lines(f, path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(path, line_no, f"not valid JSON ({e.msg} at column {e.colno}).") from None
            if not isinstance(obj, dict):
                raise DataFormatError(path, line_no, f"expected a JSON object, got {type(obj).__name__}.")
            absent = [k for k in ("sentence1", "sentence2", "gold_label") if k not in obj]
            if absent:
                raise DataFormatError(path, line_no, f"missing field(s) {absent} (MultiNLI 1.0 JSONL has "
                                                     "sentence1, sentence2, gold_label, genre, pairID).")
            premise, hypothesis = _texts(obj["sentence1"], obj["sentence2"], path, line_no)
            if not isinstance(obj["gold_label"], str):
                raise DataFormatError(path, line_no, f"gold_label {obj['gold_label']!r} is not text.")
            label = _label(obj["gold_label"], path, line_no, skip_no_consensus)
            if label is None:
                skipped.append(line_no)
                continue
            examples.append(MNLIExample(premise, hypothesis, label, str(obj.get("genre", "")),
                                        str(obj.get("pairID", ""))))
    return MNLIFile(examples, skipped)


def find_mnli_files(data_dir: str) -> dict:
    """``{"train", "dev_matched", "dev_mismatched"}`` → file paths, GLUE layout first, then JSONL."""
    for layout in (GLUE_FILES, JSONL_FILES):
        paths = {split: os.path.join(data_dir, name) for split, name in layout.items()}
        if os.path.isfile(paths["train"]) or os.path.isfile(paths["dev_matched"]):
            missing = [p for p in paths.values() if not os.path.isfile(p)]
            if missing:
                raise FileNotFoundError(f"{data_dir} holds part of an MNLI release but lacks {missing}.")
            return paths
    raise FileNotFoundError(
        f"no MNLI files in {data_dir}: expected GLUE's {sorted(GLUE_FILES.values())} or MultiNLI 1.0's "
        f"{sorted(JSONL_FILES.values())} (GLUE: https://gluebenchmark.com/tasks, "
        "MultiNLI: https://cims.nyu.edu/~sbowman/multinli/).")
