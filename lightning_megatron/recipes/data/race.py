"""RACE reader: the official ``RACE/{train,dev,test}/{middle,high}/*.txt`` release.

Each file holds one JSON object (a passage and its questions): ``article``, ``questions[]``,
``options[][4]``, ``answers[]`` (letters A-D) and ``id``. Files with one such object per line are
read too. Every question becomes one ``RaceQuestion``; a malformed file raises with its name, the
line of the object and the question's index, and nothing is skipped.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

from .errors import DataFormatError
from .text import read_utf8

NUM_CHOICES = 4
RACE_SPLITS = ("train", "dev", "test")
RACE_LEVELS = ("middle", "high")


@dataclass(frozen=True)
class RaceQuestion:
    article: str
    question: str
    options: Tuple[str, str, str, str]
    label: int          # index of the right option (answer letter - 'A')
    level: str          # "middle" or "high"
    id: str             # the passage's id and the question's index, e.g. "high1.txt#2"


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _objects(path: str) -> Iterator[Tuple[int, object]]:
    """``(line, object)`` pairs: the whole file as one JSON value, else one value per line."""
    text = read_utf8(path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as whole:
        lines = text.splitlines()
        first = next((line for line in lines if line.strip()), "")
        if not _parses(first):   # not JSON lines either: report the error of the file as one value
            raise DataFormatError(path, whole.lineno, f"not valid JSON ({whole.msg} at column {whole.colno}).") \
                from None
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(path, line_no, f"not valid JSON ({e.msg} at column {e.colno}); a RACE "
                                                     "file holds one JSON object (or one per line).") from None
        return
    yield 1 + text[:len(text) - len(text.lstrip())].count("\n"), obj


def _questions(obj: object, path: str, line: int, level: str) -> List[RaceQuestion]:
    if not isinstance(obj, dict):
        raise DataFormatError(path, line, f"expected a JSON object, got {type(obj).__name__}.")
    absent = [k for k in ("article", "questions", "options", "answers") if k not in obj]
    if absent:
        raise DataFormatError(path, line, f"missing field(s) {absent} (RACE has article, questions, options, "
                                          "answers, id).")
    article, questions, options, answers = obj["article"], obj["questions"], obj["options"], obj["answers"]
    if not isinstance(article, str) or not article.strip():
        raise DataFormatError(path, line, "article is empty or not text.")
    for name, value in (("questions", questions), ("options", options), ("answers", answers)):
        if not isinstance(value, list):
            raise DataFormatError(path, line, f"{name} must be a list, got {type(value).__name__}.")
    if not len(questions) == len(options) == len(answers):
        raise DataFormatError(path, line, f"questions, options and answers differ in length "
                                          f"({len(questions)}, {len(options)}, {len(answers)}).")
    passage_id = str(obj.get("id", os.path.basename(path)))
    out = []
    for i, (question, opts, answer) in enumerate(zip(questions, options, answers)):
        where = f"question {i}"
        if not isinstance(question, str):
            raise DataFormatError(path, line, f"{where}: the question is not text ({question!r}).")
        if not isinstance(opts, list) or len(opts) != NUM_CHOICES or not all(isinstance(o, str) for o in opts):
            raise DataFormatError(path, line, f"{where}: expected {NUM_CHOICES} options as text, got {opts!r}.")
        if not isinstance(answer, str) or len(answer) != 1 or not "A" <= answer <= "D":
            raise DataFormatError(path, line, f"{where}: answer {answer!r} is not one of 'A', 'B', 'C', 'D'.")
        out.append(RaceQuestion(article, question, tuple(opts), ord(answer) - ord("A"), level, f"{passage_id}#{i}"))
    return out


def read_race_dir(path: str, level: str) -> List[RaceQuestion]:
    """Every question of the ``*.txt``/``*.json`` files in one ``{split}/{level}`` folder, files sorted."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"RACE folder {path} not found; expected RACE/{{train,dev,test}}/{{middle,high}}/.")
    files = sorted(glob.glob(os.path.join(path, "*.txt")) + glob.glob(os.path.join(path, "*.json")))
    if not files:
        raise FileNotFoundError(f"RACE folder {path} holds no .txt or .json files.")
    questions: List[RaceQuestion] = []
    for file in files:
        for line, obj in _objects(file):
            questions.extend(_questions(obj, file, line, level))
    return questions


def read_race(root: str, split: str, levels: Sequence[str] = RACE_LEVELS) -> Dict[str, List[RaceQuestion]]:
    """``{level: questions}`` of ``root/split/level`` for each level (``root`` is the RACE folder)."""
    if split not in RACE_SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(RACE_SPLITS)}.")
    unknown = [lv for lv in levels if lv not in RACE_LEVELS]
    if unknown:
        raise ValueError(f"levels {unknown} are not RACE levels; use {list(RACE_LEVELS)}.")
    return {level: read_race_dir(os.path.join(root, split, level), level) for level in levels}
