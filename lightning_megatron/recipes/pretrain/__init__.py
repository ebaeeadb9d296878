"""Pre-training recipes: LightningModules and data a LightningCLI config can name."""

from .gpt import GPTPretraining, PatternTokens
from .llama import LlamaPretraining

__all__ = ["GPTPretraining", "LlamaPretraining", "PatternTokens"]
