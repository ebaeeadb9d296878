"""The chat recipe's data path: the assistant mask from the tokenizer's own template (checked against transformers'
``{% generation %}`` mask), packed rows that keep conversations apart, overlong conversations counted, and bad
input refused naming the file and line."""

import json
from collections import Counter

import numpy as np
import pytest

from lightning_megatron.recipes.chat import ChatData, encode_conversation, load_chat_tokenizer, read_conversations
from lightning_megatron.recipes.chat.packing import PackingStats, fit_to_length
from lightning_megatron.recipes.data import DataFormatError
from helpers.chat_utils import generation_tokenizer, write_sample


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return write_sample(tmp_path_factory.mktemp("chat"))


def _conversations(sample):
    return [c.messages for f in ("train.jsonl", "valid.jsonl") for c in read_conversations(sample / f)]


def test_assistant_mask_equals_transformers_generation_mask(sample):
    """The shipped template has no marks: its mask comes from rendered prefixes. The same template with
    {% generation %} marks gives transformers' own mask; both must agree on every sample conversation."""
    plain = load_chat_tokenizer(sample / "model")
    marked = generation_tokenizer(sample / "model")
    for messages in _conversations(sample):
        ids, mask = encode_conversation(plain, messages)                     # "auto": no marks -> prefixes
        expected = marked.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
        assert ids == list(expected["input_ids"])
        assert mask == list(expected["assistant_masks"]), plain.decode(ids)
        assert encode_conversation(marked, messages) == (ids, mask)           # "auto" with marks -> transformers'
        trained = plain.decode([t for t, m in zip(ids, mask) if m])
        assert trained == "".join(m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant")


def test_packed_rows_keep_conversations_apart(sample):
    data = ChatData([str(sample / "train.jsonl")], str(sample / "model"), seq_length=128, batch_size=4)
    data.setup("fit")
    rows = data._sets["train"]
    encoded = data.encode([str(sample / "train.jsonl")])
    seen, labelled = [], 0
    for i in range(len(rows)):
        row = rows[i]
        ids, labels, pos, docs = (row[k].numpy() for k in ("input_ids", "labels", "position_ids", "document_ids"))
        for d in range(docs.max() + 1):
            where = np.flatnonzero(docs == d)
            assert (np.diff(where) == 1).all() and (pos[where] == np.arange(len(where))).all()
            conversation = next(e for e in encoded if list(ids[where]) == e[0])
            seen.append(tuple(conversation[0]))
            mask = np.asarray(conversation[1], dtype=bool)
            expected = np.where(mask[1:], ids[where][1:], -100)
            assert (labels[where][:-1] == expected).all() and labels[where][-1] == -100
        assert (labels[docs < 0] == -100).all()
        labelled += int((labels != -100).sum())
    assert Counter(seen) == Counter(tuple(e[0]) for e in encoded)       # every conversation once
    assert labelled == data.stats["train"].trained_tokens == sum(sum(m[1:]) for _, m in encoded)


def test_overlong_conversations_are_truncated_or_dropped_and_counted():
    encoded = [([1] * 5, [0, 0, 1, 1, 1]), ([1] * 12, [0] * 6 + [1] * 6), ([1] * 12, [0, 1] + [0] * 10)]
    stats = PackingStats()
    kept = fit_to_length(encoded, 8, "truncate", stats)
    assert [len(k[0]) for k in kept] == [5, 8, 8] and stats.truncated == 2 and stats.dropped_untrained == 0
    assert stats.trained_tokens == 3 + 2 + 1
    stats = PackingStats()
    kept = fit_to_length(encoded, 8, "drop", stats)
    assert len(kept) == 1 and stats.dropped_overlong == 2 and stats.trained_tokens == 3
    stats = PackingStats()
    fit_to_length([([1] * 12, [0] * 10 + [1] * 2)], 8, "truncate", stats)   # its answer lies past the cut
    assert stats.dropped_untrained == 1 and "1 dropped with no assistant token" in stats.describe()


@pytest.mark.parametrize("line, problem", [
    ('{"text": "hi"}', "no 'messages' key"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "role='robot'"),
    ('{"messages": [{"role": "user"}]}', "must be an object with 'role' and 'content'"),
    ('{"messages": ', "not valid JSON"),
])
def test_bad_lines_name_the_file_and_line(tmp_path, line, problem):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    path = tmp_path / "chat.jsonl"
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(DataFormatError, match=f"chat.jsonl, line 3: .*{problem}"):
        read_conversations(path)


def test_sharegpt_lines_read_as_messages(tmp_path):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                                  {"from": "gpt", "value": "a"}]}) + "\n")
    assert read_conversations(path)[0].messages == [{"role": "system", "content": "s"},
                                                    {"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]


def test_template_without_prefix_property_is_refused_naming_file_line_and_tokenizer(sample, tmp_path):
    """A template that renders an earlier answer differently once more turns follow (here: it drops the
    reasoning of every assistant message but the last, as some reasoning models' templates do)."""
    tokenizer = load_chat_tokenizer(sample / "model")
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "message['content'] | trim", "(message['content'] if loop.last else message['content'].split('</think>')[-1])"
        " | trim")
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r</think>a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": turns[:2]}) + "\n" + json.dumps({"messages": turns}))
    data = ChatData([str(tmp_path / "chat.jsonl")], str(tmp_path / "tok"), seq_length=64, batch_size=1)
    with pytest.raises(DataFormatError, match=r"chat.jsonl, line 2: the chat template of tokenizer '.*tok' has no "
                                              r"prefix property at message 1.*\{% generation %\}"):
        data.setup("fit")
