"""Models built only from the tensor-parallel, pipeline-aware blocks."""

from .bert import (
    BertForMaskedLM, BertForMultipleChoice, BertForSequenceClassification, BertLMHead, BertModel, BertOutput,
)
from .embedding import LanguageModelEmbedding, parallel_logits
from .gpt import GPTModel

__all__ = ["BertForMaskedLM", "BertForMultipleChoice", "BertForSequenceClassification", "BertLMHead",
           "BertModel", "BertOutput", "GPTModel", "LanguageModelEmbedding", "parallel_logits"]
