"""Pre-training text: a tokenized, memory-mapped corpus, sequences cut from it, weighted blends.

``python -m lightning_megatron.recipes.corpus.sample OUT`` writes a small text corpus and a BPE tokenizer;
``python -m lightning_megatron.recipes.corpus.preprocess`` tokenizes text files into a token file;
:class:`PretrainingData` serves fixed-length or packed sequences from one or several of them.
"""

from .datamodule import PretrainingData
from .datasets import BlendedDataset, PackedDocuments, TokenWindows, blend_indices
from .token_file import TokenFile, write_token_file

__all__ = ["BlendedDataset", "PackedDocuments", "PretrainingData", "TokenFile", "TokenWindows", "blend_indices",
           "write_token_file"]
