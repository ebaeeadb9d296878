"""MNLI readers on small files written here in GLUE's TSV and MultiNLI's JSONL formats, and the shipped sample."""

import filecmp
import json
import os
import subprocess
import sys

import pytest

from lightning_megatron.recipes.data import (
    MNLI_LABELS, SAMPLE_DIR, DataFormatError, MNLIDataModule, find_mnli_files, read_mnli,
)

from helpers.paths import ROOT

# GLUE's MNLI headers: train has label1 only, dev label1..label5, test no labels.
TRAIN_HEADER = ("index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
                "sentence2_parse sentence1 sentence2 label1 gold_label").split()
DEV_HEADER = TRAIN_HEADER[:11] + ["label2", "label3", "label4", "label5", "gold_label"]
TEST_HEADER = TRAIN_HEADER[:10]


def tsv_row(i, premise, hypothesis, labels):
    return [str(i), str(100 + i), f"{100 + i}e", "fiction", "( a b )", "( c d )", "(ROOT a)", "(ROOT c)",
            premise, hypothesis, *labels]


def write_tsv(path, header, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\t".join(header) + "\n")
        for row in rows:
            f.write("\t".join(row) + "\n")
    return str(path)


def write_jsonl(path, objects):
    with open(path, "w", encoding="utf-8") as f:
        for obj in objects:
            f.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    return str(path)


def jsonl_obj(premise, hypothesis, gold, genre="slate", pair="7e"):
    return {"annotator_labels": [gold], "genre": genre, "gold_label": gold, "pairID": pair, "promptID": "7",
            "sentence1": premise, "sentence1_binary_parse": "( x )", "sentence2": hypothesis, "sentence2_parse": "(x)"}


def test_glue_train_dev_and_test_files(tmp_path):
    # quotes stay as they are: GLUE's fields are not CSV-quoted
    train = write_tsv(tmp_path / "train.tsv", TRAIN_HEADER, [
        tsv_row(0, 'He said "yes".', "He agreed.", ["entailment", "entailment"]),
        tsv_row(1, "It rained.", "It was dry.", ["contradiction", "contradiction"]),
    ])
    examples, skipped = read_mnli(train)
    assert skipped == []
    assert [e.premise for e in examples] == ['He said "yes".', "It rained."]
    assert [MNLI_LABELS[e.label] for e in examples] == ["entailment", "contradiction"]
    assert examples[0].genre == "fiction" and examples[0].pair_id == "100e"

    dev = write_tsv(tmp_path / "dev_matched.tsv", DEV_HEADER,
                    [tsv_row(0, "A man sleeps.", "A person rests.", ["neutral"] * 5 + ["neutral"])])
    assert read_mnli(dev).examples[0].label == MNLI_LABELS.index("neutral")

    test = write_tsv(tmp_path / "test_matched.tsv", TEST_HEADER, [tsv_row(0, "A dog.", "An animal.", [])])
    assert read_mnli(test).examples[0].label is None


def test_glue_row_with_missing_column_names_file_and_line(tmp_path):
    rows = [tsv_row(0, "A.", "B.", ["neutral", "neutral"]), tsv_row(1, "C.", "D.", ["neutral"])]
    path = write_tsv(tmp_path / "train.tsv", TRAIN_HEADER, rows)
    with pytest.raises(DataFormatError, match=r"train\.tsv, line 3: expected 12 tab-separated columns.*found 11"):
        read_mnli(path)


@pytest.mark.parametrize("label, problem", [("entailed", r"gold_label 'entailed' is not one of"),
                                            ("-", r"gold_label is .-. .*skip_no_consensus=True")])
def test_glue_bad_labels(tmp_path, label, problem):
    path = write_tsv(tmp_path / "train.tsv", TRAIN_HEADER, [tsv_row(0, "A.", "B.", ["neutral", label])])
    with pytest.raises(DataFormatError, match=r"line 2: " + problem):
        read_mnli(path)


def test_glue_empty_sentence_and_bad_header(tmp_path):
    path = write_tsv(tmp_path / "train.tsv", TRAIN_HEADER, [tsv_row(0, "A.", " ", ["neutral", "neutral"])])
    with pytest.raises(DataFormatError, match=r"line 2: sentence2 is empty"):
        read_mnli(path)
    bad = write_tsv(tmp_path / "dev_matched.tsv", ["premise", "hypothesis", "label"], [["A.", "B.", "neutral"]])
    with pytest.raises(DataFormatError, match=r"line 1: the header lacks column\(s\) \['sentence1', 'sentence2'\]"):
        read_mnli(bad)


def test_jsonl_release_and_no_consensus_rows(tmp_path):
    path = write_jsonl(tmp_path / "multinli_1.0_dev_matched.jsonl", [
        jsonl_obj("The cat sat.", "A cat sat.", "entailment"),
        jsonl_obj("The cat sat.", "The cat ran.", "-"),
        jsonl_obj("The cat sat.", "The cat is black.", "neutral", genre="travel", pair="8n"),
    ])
    with pytest.raises(DataFormatError, match=r"multinli_1\.0_dev_matched\.jsonl, line 2: gold_label is '-'"):
        read_mnli(path)
    examples, skipped = read_mnli(path, skip_no_consensus=True)
    assert skipped == [2]
    assert [(e.hypothesis, e.label, e.genre, e.pair_id) for e in examples] == [
        ("A cat sat.", MNLI_LABELS.index("entailment"), "slate", "7e"),
        ("The cat is black.", MNLI_LABELS.index("neutral"), "travel", "8n")]


@pytest.mark.parametrize("line, problem", [
    ('{"sentence1": "A.", "sentence2": "B.", "gold_label": "neutral"', r"not valid JSON"),
    ('{"sentence1": "A.", "gold_label": "neutral"}', r"missing field\(s\) \['sentence2'\]"),
    ('["A.", "B.", "neutral"]', r"expected a JSON object"),
    ('{"sentence1": "A.", "sentence2": "B.", "gold_label": 1}', r"gold_label 1 is not text"),
])
def test_jsonl_malformed_lines(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "multinli_1.0_train.jsonl", [jsonl_obj("A.", "B.", "neutral"), line])
    with pytest.raises(DataFormatError, match=r"multinli_1\.0_train\.jsonl, line 2: " + problem):
        read_mnli(path)


def test_find_files_of_either_release(tmp_path):
    glue, jsonl = tmp_path / "glue", tmp_path / "multinli"
    glue.mkdir(), jsonl.mkdir()
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        write_tsv(glue / name, TRAIN_HEADER, [])
    assert find_mnli_files(str(glue))["dev_mismatched"].endswith("dev_mismatched.tsv")
    for split in ("train", "dev_matched"):
        write_jsonl(jsonl / f"multinli_1.0_{split}.jsonl", [])
    with pytest.raises(FileNotFoundError, match=r"lacks .*multinli_1\.0_dev_mismatched\.jsonl"):
        find_mnli_files(str(jsonl))
    with pytest.raises(FileNotFoundError, match=r"no MNLI files in .*train\.tsv"):
        find_mnli_files(str(tmp_path))


def test_datamodule_skips_no_consensus_rows_only_when_asked(tmp_path):
    for split in ("train", "dev_matched", "dev_mismatched"):
        write_jsonl(tmp_path / f"multinli_1.0_{split}.jsonl",
                    [jsonl_obj("A cat sat.", "A cat sat.", "entailment"), jsonl_obj("A.", "B.", "-")])
    dm = MNLIDataModule(str(tmp_path), tokenizer=SAMPLE_DIR, batch_size=1)
    dm.setup("fit")
    assert {k: len(v) for k, v in dm.datasets.items()} == {"train": 1, "dev_matched": 1, "dev_mismatched": 1}
    with pytest.raises(DataFormatError, match="line 2"):
        MNLIDataModule(str(tmp_path), tokenizer=SAMPLE_DIR, skip_no_consensus=False).setup("fit")


def test_shipped_sample_is_what_the_script_writes(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_mnli_sample.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    names = ["train.tsv", "dev_matched.tsv", "dev_mismatched.tsv", "vocab.txt", "tokenizer_config.json"]
    match, mismatch, errors = filecmp.cmpfiles(SAMPLE_DIR, tmp_path, names, shallow=False)
    assert mismatch == [] and errors == [], "rerun: python examples/make_mnli_sample.py"
    files = find_mnli_files(SAMPLE_DIR)
    sizes = {split: len(read_mnli(path).examples) for split, path in files.items()}
    assert sizes == {"train": 600, "dev_matched": 102, "dev_mismatched": 102}
    train = read_mnli(files["train"]).examples
    assert sorted({e.label for e in train}) == [0, 1, 2]
    assert sum(e.label == 0 for e in train) == 200
    mismatched_genres = {e.genre for e in read_mnli(files["dev_mismatched"]).examples}
    assert mismatched_genres.isdisjoint({e.genre for e in train})


@pytest.mark.parametrize("name, write", [
    ("train.tsv", lambda p, rows: write_tsv(p, TRAIN_HEADER, [tsv_row(i, a, b, ["neutral"] * 2) for i, (a, b) in
                                                              enumerate(rows)])),
    ("multinli_1.0_train.jsonl", lambda p, rows: write_jsonl(p, [json.dumps(jsonl_obj(a, b, "neutral"),
                                                                            ensure_ascii=False) for a, b in rows])),
])
def test_undecodable_bytes_name_file_and_line(tmp_path, name, write):
    path = write(tmp_path / name, [("A cat sat.", "A cat sat."), ("Caf\u00e9 one.", "Caf\u00e9 two."), ("C.", "D.")])
    data = open(path, "rb").read().replace("Caf\u00e9 two".encode(), "Caf\u00e9 two".encode("latin-1"))
    open(path, "wb").write(data)
    line = 3 if name.endswith(".tsv") else 2
    with pytest.raises(DataFormatError, match=rf"{name}, line {line}: byte 0xe9 at byte \d+ of the line is not "
                                              r"UTF-8.*iconv"):
        read_mnli(path)


def test_training_and_dev_files_need_the_label_column(tmp_path):
    headers = {"train": TRAIN_HEADER[:-1], "dev_matched": DEV_HEADER, "dev_mismatched": DEV_HEADER}
    for split, header in headers.items():
        labels = ["neutral"] * (len(header) - 10)
        write_tsv(tmp_path / f"{split}.tsv", header, [tsv_row(0, "A cat sat.", "A cat sat.", labels)])
    assert read_mnli(tmp_path / "train.tsv").examples[0].label is None    # unlabeled files still read
    with pytest.raises(DataFormatError, match=r"train\.tsv, line 1: the header has no gold_label column.*"
                                              r"training and validation need labels"):
        read_mnli(tmp_path / "train.tsv", require_labels=True)
    with pytest.raises(DataFormatError, match=r"train\.tsv, line 1: the header has no gold_label column"):
        MNLIDataModule(str(tmp_path), tokenizer=SAMPLE_DIR, batch_size=1).setup("fit")
    write_tsv(tmp_path / "train.tsv", TRAIN_HEADER, [tsv_row(0, "A cat sat.", "A cat sat.", ["neutral"] * 2)])
    write_tsv(tmp_path / "dev_mismatched.tsv", TEST_HEADER, [tsv_row(0, "A cat sat.", "A cat sat.", [])])
    with pytest.raises(DataFormatError, match=r"dev_mismatched\.tsv, line 1: the header has no gold_label column"):
        MNLIDataModule(str(tmp_path), tokenizer=SAMPLE_DIR, batch_size=1).setup("validate")


def test_jsonl_training_row_without_label(tmp_path):
    unlabeled = {k: v for k, v in jsonl_obj("A.", "B.", "neutral").items() if k != "gold_label"}
    path = write_jsonl(tmp_path / "multinli_1.0_train.jsonl", [jsonl_obj("A.", "B.", "neutral"), unlabeled])
    with pytest.raises(DataFormatError, match=r"multinli_1\.0_train\.jsonl, line 2: missing field\(s\) "
                                              r"\['gold_label'\]"):
        read_mnli(path)
