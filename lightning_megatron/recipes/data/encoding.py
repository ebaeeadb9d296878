"""How a text pair becomes one BERT input: ``[CLS] a [SEP] b [SEP]``, token types 0…0 1…1.

MNLI truncates the longer of premise/hypothesis first (``longest_first``, exactly as Hugging
Face's fast tokenizers do). RACE keeps the question+option (up to ``max_qa_length`` tokens) and
cuts the article's tail. Cloze questions (``"... _ ..."``) get the option written into the blank,
as Megatron-LM's and BERT's RACE recipes do; others are followed by the option.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple


def longest_first(len_a: int, len_b: int, budget: int) -> Tuple[int, int]:
    """Tokens kept of ``a`` and ``b`` when together they may hold ``budget``, as the ``tokenizers``
    library's ``longest_first`` does: the shorter text stays whole if it fits in half the budget and
    the longer one gets the rest; otherwise the shorter (``a`` on a tie) gets ``budget // 2`` and the
    longer the other half."""
    if len_a + len_b <= budget:
        return len_a, len_b
    a_is_short = len_a <= len_b
    short = min(len_a, len_b)
    if 2 * short > budget:
        short = budget // 2
    long = budget - short
    return (short, long) if a_is_short else (long, short)


def build_pair(a: Sequence[int], b: Sequence[int], cls_id: int, sep_id: int) -> Tuple[List[int], int]:
    """``[CLS] a [SEP] b [SEP]`` and the length of its first segment (``[CLS] a [SEP]``)."""
    return [cls_id, *a, sep_id, *b, sep_id], len(a) + 2


def token_types(length: int, first_length: int) -> List[int]:
    return [0] * first_length + [1] * (length - first_length)


def race_query(question: str, option: str) -> str:
    """The question with ``option`` in its blank (cloze), else the question followed by the option."""
    if "_" in question:
        return question.replace("_", option)
    return f"{question} {option}"
