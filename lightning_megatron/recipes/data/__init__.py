"""MNLI and RACE: readers of the official formats, WordPiece tokenization, datasets, datamodules."""

from .datamodules import MNLIDataModule, RaceDataModule
from .datasets import IGNORE_LABEL, MNLIDataset, PadCollate, RaceDataset
from .encoding import build_pair, longest_first, race_query
from .errors import DataFormatError
from .mnli import MNLI_LABELS, MNLIExample, MNLIFile, find_mnli_files, read_mnli, read_mnli_jsonl, read_mnli_tsv
from .race import RACE_LEVELS, RACE_SPLITS, RaceQuestion, read_race, read_race_dir
from .sources import MINILM, MINILM_IF_INSTALLED, SAMPLE_DIR, minilm_path, resolve_pretrained
from .tokenizer import WordPieceTokenizer

__all__ = [
    "DataFormatError", "IGNORE_LABEL", "MINILM", "MINILM_IF_INSTALLED", "MNLIDataModule", "MNLIDataset",
    "MNLIExample", "MNLIFile", "MNLI_LABELS", "PadCollate", "RACE_LEVELS", "RACE_SPLITS", "RaceDataModule",
    "RaceDataset", "RaceQuestion", "SAMPLE_DIR", "WordPieceTokenizer", "build_pair", "find_mnli_files",
    "longest_first", "minilm_path", "race_query", "read_mnli", "read_mnli_jsonl", "read_mnli_tsv", "read_race",
    "read_race_dir", "resolve_pretrained",
]
