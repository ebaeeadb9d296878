"""A conversation through the tokenizer's own chat template, and which of its tokens the assistant wrote.

The template is the one the model was released with (``tokenizer_config.json`` or ``chat_template.jinja``),
rendered by transformers' ``apply_chat_template``: no hand-written format can drift from what the model sees
at inference. Which tokens to train on:

- ``"generation"``: the template marks the assistant's part with ``{% generation %}...{% endgeneration %}``;
  transformers returns that mask (``return_assistant_tokens_mask=True``).
- ``"prefix"`` (most released templates have no markers): the tokens an assistant turn adds. Render
  ``messages[:i]`` with the generation prompt and ``messages[:i+1]``: the tokens after the first and up to the
  end of the second are the assistant's (its content, its end-of-turn token and any separator the template
  writes after the turn). This needs templates that render earlier turns the same whatever follows, which is
  checked on every conversation; one that does not (e.g. one that drops earlier turns' reasoning) is refused,
  naming the tokenizer and the message.
- ``"auto"`` (default): ``"generation"`` when the template has the markers, else ``"prefix"``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, List, Sequence, Tuple, Union

from .conversations import Message

METHODS = ("auto", "generation", "prefix")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_chat_tokenizer(path: Union[str, Path]) -> Any:
    """The ``transformers`` tokenizer of a local folder; it must carry a chat template."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer {str(path)!r} is not a folder; give a Hugging Face model or tokenizer "
                                "folder (tokenizer.json, tokenizer_config.json with its chat_template).")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise ValueError(f"the tokenizer in {str(path)!r} has no (single) chat template: the recipe formats "
                         "conversations with the model's own template (chat_template in tokenizer_config.json "
                         "or chat_template.jinja); add one to that folder.")
    return tokenizer


def has_generation_markers(template: str) -> bool:
    return _GENERATION.search(template) is not None


def _ids(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> List[int]:
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=True)
    return [int(t) for t in out["input_ids"]]


def _name(tokenizer: Any) -> str:
    return f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _not_a_prefix(tokenizer: Any, i: int, what: str, shorter: List[int], longer: List[int]) -> str:
    k = _first_difference(shorter, longer)
    return (f"the chat template of {_name(tokenizer)} has no prefix property at message {i}: the rendering of "
            f"{what} (they differ from token {k} on: "
            f"{tokenizer.decode(shorter[k:k + 8])!r} vs {tokenizer.decode(longer[k:k + 8])!r}), so the assistant's "
            "tokens cannot be found by rendering prefixes. Mark them in the template with "
            "{% generation %}...{% endgeneration %} (then assistant_mask 'auto' or 'generation' reads the marks).")


def _prefix_mask(tokenizer: Any, messages: Sequence[Message]) -> Tuple[List[int], List[int]]:
    ids = _ids(tokenizer, messages, False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _ids(tokenizer, messages[:i], True)
        turn = _ids(tokenizer, messages[:i + 1], False)
        for shorter, longer, what in (
                (prompt, turn, f"messages[:{i + 1}] does not start with that of messages[:{i}] + the generation prompt"),
                (turn, ids, f"the whole conversation does not start with that of messages[:{i + 1}]")):
            if longer[:len(shorter)] != shorter:
                raise ValueError(_not_a_prefix(tokenizer, i, what, shorter, longer))
        if len(turn) == len(prompt):
            raise ValueError(f"the chat template of {_name(tokenizer)} renders assistant message {i} as no tokens.")
        mask[len(prompt):len(turn)] = [1] * (len(turn) - len(prompt))
    return ids, mask


def _generation_mask(tokenizer: Any, messages: Sequence[Message]) -> Tuple[List[int], List[int]]:
    if not has_generation_markers(tokenizer.chat_template):
        raise ValueError(f"assistant_mask='generation' needs {{% generation %}} markers in the chat template of "
                         f"{_name(tokenizer)}, which has none; use 'prefix' (or 'auto').")
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = [int(t) for t in out["input_ids"]], [int(m) for m in out["assistant_masks"]]
    if not any(mask):
        raise ValueError(f"the chat template of {_name(tokenizer)} marks no token of this conversation's assistant "
                         "messages inside {% generation %}.")
    return ids, mask


def encode_conversation(tokenizer: Any, messages: Sequence[Message], method: str = "auto"
                        ) -> Tuple[List[int], List[int]]:
    """(token ids of the whole conversation, 1 on the assistant's tokens else 0), by ``method`` (module doc)."""
    if method not in METHODS:
        raise ValueError(f"assistant_mask={method!r} is not one of {list(METHODS)}.")
    if method == "generation" or (method == "auto" and has_generation_markers(tokenizer.chat_template)):
        return _generation_mask(tokenizer, messages)
    return _prefix_mask(tokenizer, messages)
