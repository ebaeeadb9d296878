"""Models built only from the tensor-parallel, pipeline-aware blocks."""

from .bert import (
    BertForMaskedLM, BertForMultipleChoice, BertForSequenceClassification, BertLMHead, BertModel, BertOutput,
)
from .embedding import LanguageModelEmbedding, parallel_logits
from .gpt import GPTModel
from .llama import LlamaModel, llama_config, mixtral_config

__all__ = ["BertForMaskedLM", "BertForMultipleChoice", "BertForSequenceClassification", "BertLMHead",
           "BertModel", "BertOutput", "GPTModel", "LanguageModelEmbedding", "LlamaModel", "llama_config",
           "mixtral_config", "parallel_logits"]
