"""Pre-training recipes: LightningModules and data a LightningCLI config can name."""

from .gpt import GPTPretraining, PatternTokens

__all__ = ["GPTPretraining", "PatternTokens"]
