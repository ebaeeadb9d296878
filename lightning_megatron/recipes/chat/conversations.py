"""Read chat conversations from JSONL: one conversation a line, checked so a bad line fails naming its place.

Two layouts are read:

- ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`` (OpenAI / transformers);
- ``{"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}`` (ShareGPT), renamed to the
  first layout (``human`` -> ``user``, ``gpt`` -> ``assistant``).

Every conversation needs at least one assistant message: only assistant tokens are trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Union

from ..data.errors import DataFormatError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}

Message = Dict[str, str]


@dataclass
class Conversation:
    """One line's messages and where they came from (for error messages further down the path)."""

    messages: List[Message]
    path: str
    line: int


def _messages(record: Dict[str, Any], path: str, line: int) -> List[Message]:
    if "messages" in record:
        key, role_key, content_key, names = "messages", "role", "content", {r: r for r in ROLES}
    elif "conversations" in record:
        key, role_key, content_key, names = "conversations", "from", "value", SHAREGPT_ROLES
    else:
        raise DataFormatError(path, line, f"no 'messages' key (found {sorted(record)}); each line must be "
                              '{"messages": [{"role": ..., "content": ...}, ...]} (or ShareGPT\'s "conversations").')
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise DataFormatError(path, line, f"'{key}' must be a non-empty list of messages, got {turns!r:.80}.")
    out: List[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise DataFormatError(path, line, f"'{key}'[{i}] must be an object with '{role_key}' and "
                                  f"'{content_key}', got {turn!r:.80}.")
        role, content = turn[role_key], turn[content_key]
        if role not in names:
            raise DataFormatError(path, line, f"'{key}'[{i}] has {role_key}={role!r}; known: {sorted(names)}.")
        if not isinstance(content, str):
            raise DataFormatError(path, line, f"'{key}'[{i}].{content_key} must be a string, got "
                                  f"{type(content).__name__}.")
        out.append({"role": names[role], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataFormatError(path, line, f"'{key}' has no assistant message: nothing to train on.")
    return out


def read_conversations(path: Union[str, Path]) -> List[Conversation]:
    """Every conversation of a JSONL file, in order (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no conversation file {str(path)!r}; give a JSONL file, one conversation a line.")
    out: List[Conversation] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(str(path), line_no, f"not valid JSON ({e.msg} at column {e.colno}).") from None
            if not isinstance(record, dict):
                raise DataFormatError(str(path), line_no, f"expected a JSON object, got {type(record).__name__}.")
            out.append(Conversation(_messages(record, str(path), line_no), str(path), line_no))
    if not out:
        raise DataFormatError(str(path), None, "holds no conversation.")
    return out
