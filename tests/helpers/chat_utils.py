"""What the chat-recipe tests share: the project's tiny chat sample, and an independent reference for its
assistant tokens and loss (transformers' own ``return_assistant_tokens_mask`` on the sample's template with
``{% generation %}`` marks, and ``LlamaForCausalLM`` run one conversation at a time)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F


def write_sample(folder):
    from lightning_megatron.recipes.chat.sample import write_chat_sample

    return write_chat_sample(Path(folder))


def generation_tokenizer(model_dir):
    """The sample's tokenizer with the same template, marked with {% generation %} for transformers' mask."""
    from transformers import AutoTokenizer

    from lightning_megatron.recipes.chat.sample import CHAT_TEMPLATE_WITH_GENERATION

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE_WITH_GENERATION
    return tokenizer


def reference_examples(model_dir, jsonl):
    """[(ids, HF labels: ids on the assistant's tokens, -100 elsewhere)] of every conversation of ``jsonl``."""
    tokenizer = generation_tokenizer(model_dir)
    out = []
    for line in Path(jsonl).read_text().splitlines():
        encoded = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = torch.tensor(encoded["input_ids"])
        mask = torch.tensor(encoded["assistant_masks"], dtype=torch.bool)
        out.append((ids, torch.where(mask, ids, torch.full_like(ids, -100))))
    return out


@torch.no_grad()
def hf_loss_sum_and_count(model, examples):
    """Summed next-token loss over the labelled tokens, and their count, one conversation per forward."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, labels in examples:
        logits = model(ids[None]).logits[0].float()
        total += F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum").double()
        count += int((labels[1:] != -100).sum())
    return float(total), count
