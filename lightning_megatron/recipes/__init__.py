"""Recipes built on the library: the LightningCLI entry point (``cli``), BERT fine-tuning on MNLI and RACE
(``finetune``, with their readers in ``data``), GPT/Llama pre-training (``pretrain``) and its token corpus
(``corpus``), chat fine-tuning of an imported Hugging Face model (``chat``). Nothing in the library imports them."""
