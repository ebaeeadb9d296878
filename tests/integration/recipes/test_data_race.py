"""RACE reader on a small RACE/{split}/{level}/*.txt tree written here, including malformed files."""

import json

import pytest

from lightning_megatron.recipes.data import RACE_LEVELS, DataFormatError, read_race, read_race_dir


def passage(pid, n=2, **changes):
    obj = {"id": pid, "article": f"Article {pid}. Tom went to school.",
           "questions": [f"Question {i} of {pid}?" for i in range(n)],
           "options": [[f"opt{i}{c}" for c in "abcd"] for i in range(n)],
           "answers": ["ABCD"[i % 4] for i in range(n)]}
    obj.update(changes)
    return obj


def write_race(root, files):
    """``files``: {(split, level, name): object or raw text}."""
    for (split, level, name), content in files.items():
        folder = root / split / level
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return str(root)


def test_reads_every_question_of_every_level(tmp_path):
    root = write_race(tmp_path, {
        ("dev", "middle", "2.txt"): passage("middle2.txt", n=3),
        ("dev", "middle", "1.txt"): passage("middle1.txt"),
        ("dev", "high", "9.txt"): "\n" + json.dumps(passage("high9.txt", n=1)),
    })
    out = read_race(root, "dev")
    assert list(out) == list(RACE_LEVELS)
    middle = out["middle"]
    assert [q.id for q in middle] == ["middle1.txt#0", "middle1.txt#1", "middle2.txt#0", "middle2.txt#1",
                                      "middle2.txt#2"]   # files in sorted order
    assert [q.label for q in middle] == [0, 1, 0, 1, 2]
    assert middle[0].options == ("opt0a", "opt0b", "opt0c", "opt0d")
    assert middle[0].article == "Article middle1.txt. Tom went to school." and middle[0].level == "middle"
    assert [q.level for q in out["high"]] == ["high"]


def test_json_lines_files(tmp_path):
    text = json.dumps(passage("a")) + "\n\n" + json.dumps(passage("b", n=1)) + "\n"
    root = write_race(tmp_path, {("train", "high", "all.txt"): text})
    assert [q.id for q in read_race_dir(str(tmp_path / "train" / "high"), "high")] == ["a#0", "a#1", "b#0"]
    broken = json.dumps(passage("a")) + "\n" + '{"article": "x",'
    write_race(tmp_path, {("train", "high", "all.txt"): broken})
    with pytest.raises(DataFormatError, match=r"all\.txt, line 2: not valid JSON"):
        read_race(root, "train", levels=["high"])


@pytest.mark.parametrize("changes, problem", [
    (dict(options=[["a", "b", "c"], ["a", "b", "c", "d"]]), r"question 0: expected 4 options"),
    (dict(answers=["A", "E"]), r"question 1: answer 'E' is not one of"),
    (dict(answers=["A"]), r"questions, options and answers differ in length \(2, 2, 1\)"),
    (dict(article=""), r"article is empty"),
    (dict(questions="Why?"), r"questions must be a list"),
])
def test_malformed_passages_name_file_line_and_question(tmp_path, changes, problem):
    good = passage("ok.txt")
    bad = passage("bad.txt", **changes)
    text = json.dumps(good) + "\n" + json.dumps(bad) + "\n"
    root = write_race(tmp_path, {("test", "middle", "bad.txt"): text})
    with pytest.raises(DataFormatError, match=r"bad\.txt, line 2: " + problem):
        read_race(root, "test", levels=["middle"])


def test_missing_field_and_invalid_single_object(tmp_path):
    obj = passage("x.txt")
    del obj["answers"]
    root = write_race(tmp_path, {("dev", "high", "x.txt"): obj})
    with pytest.raises(DataFormatError, match=r"x\.txt, line 1: missing field\(s\) \['answers'\]"):
        read_race(root, "dev", levels=["high"])
    pretty = json.dumps(passage("y.txt"), indent=1)
    write_race(tmp_path, {("dev", "high", "x.txt"): pretty[:-3]})
    with pytest.raises(DataFormatError, match=r"x\.txt, line \d+: not valid JSON"):
        read_race(root, "dev", levels=["high"])


def test_missing_folders_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dev/middle not found"):
        read_race(str(tmp_path), "dev")
    (tmp_path / "dev" / "middle").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"holds no \.txt or \.json files"):
        read_race(str(tmp_path), "dev", levels=["middle"])
    with pytest.raises(ValueError, match=r"split='valid'"):
        read_race(str(tmp_path), "valid")


def test_undecodable_bytes_name_file_and_line(tmp_path):
    good = json.dumps(passage("ok.txt")) + "\n"
    bad = json.dumps(passage("bad.txt", article="Caf\u00e9 de Paris."), ensure_ascii=False)
    folder = tmp_path / "train" / "high"
    folder.mkdir(parents=True)
    (folder / "1.txt").write_bytes((good + bad + "\n").encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"1\.txt, line 2: byte 0xe9 at byte 34 of the line is not UTF-8.*iconv"):
        read_race(str(tmp_path), "train", levels=["high"])


@pytest.mark.parametrize("changes, problem", [
    (dict(answers=None), r"answers must be a list"),
    (dict(answers=["A", ""]), r"question 1: answer '' is not one of 'A', 'B', 'C', 'D'"),
    (dict(answers=["A", None]), r"question 1: answer None is not one of"),
])
def test_training_question_without_answer(tmp_path, changes, problem):
    root = write_race(tmp_path, {("train", "middle", "1.txt"): passage("1.txt", **changes)})
    with pytest.raises(DataFormatError, match=r"1\.txt, line 1: " + problem):
        read_race(root, "train", levels=["middle"])
