"""A tiny chat sample written locally: a random Llama, its chat-template tokenizer and JSONL conversations.

The model is in Hugging Face layout; the tokenizer is a byte-level BPE whose ``tokenizer_config.json`` carries a
Llama-3-style chat template.

    python -m lightning_megatron.recipes.chat.sample OUT [--train 64] [--valid 16]

writes ``OUT/model/`` (``config.json``, ``model.safetensors``, the tokenizer files with the chat template),
``OUT/train.jsonl`` and ``OUT/valid.jsonl``. The conversations come from a few templates with a fixed seed
(arithmetic questions, spelled words, follow-up turns, optional system prompts; no download): a tiny model learns
their regularities in a few dozen steps, so a falling loss shows the whole path works. It says nothing about
chat quality.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

BOS, HEADER_START, HEADER_END, END_OF_TURN, PAD = (
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>")
SPECIAL_TOKENS = [BOS, HEADER_START, HEADER_END, END_OF_TURN, PAD]

# Llama-3's layout (header, blank line, trimmed content, end-of-turn). GENERATION marks the assistant's part the
# way transformers' ``return_assistant_tokens_mask`` reads it; the sample ships the template without the markers,
# as most released templates are, so the recipe's own mask (rendered prefixes) is what trains it.
_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "@@{{- message['content'] | trim + '<|eot_id|>' }}##"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
CHAT_TEMPLATE = _TEMPLATE.replace("@@", "").replace("##", "")
CHAT_TEMPLATE_WITH_GENERATION = _TEMPLATE.replace("@@", "{% generation %}").replace("##", "{% endgeneration %}")

SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer in one short sentence.", "You are a careful calculator."]
WORDS = ["cat", "lamp", "river", "garden", "violin", "market", "kite", "bridge", "apple", "harbor"]
MODEL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)

Message = Dict[str, str]


def _conversation(rng: random.Random) -> List[Message]:
    messages: List[Message] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if rng.random() < 0.6:
            k = rng.randrange(2, 4)
            messages += [{"role": "user", "content": f"And times {k}?"},
                         {"role": "assistant", "content": f"{a + b} times {k} is {(a + b) * k}."}]
    elif kind == 1:
        word = rng.choice(WORDS)
        messages += [{"role": "user", "content": f"Spell the word {word}."},
                     {"role": "assistant", "content": " ".join(word) + "."}]
    else:
        word = rng.choice(WORDS)
        messages += [{"role": "user", "content": f"How many letters does {word} have?"},
                     {"role": "assistant", "content": f"{word} has {len(word)} letters."}]
    return messages


def sample_conversations(count: int, seed: int = 0) -> List[List[Message]]:
    rng = random.Random(seed)
    return [_conversation(rng) for _ in range(count)]


def build_tokenizer(texts: Sequence[str], vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, wrapped as ``PreTrainedTokenizerFast`` with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=END_OF_TURN, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE)


def write_chat_sample(out: Path, train: int = 64, valid: int = 16, seed: int = 0) -> Path:
    """Write the model folder (weights + tokenizer) and the two JSONL files under ``out``; return ``out``."""
    import torch
    import transformers

    out = Path(out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    conversations = sample_conversations(train + valid, seed)
    texts = [m["content"] for c in sample_conversations(2000, seed + 1) for m in c]
    texts += ["system user assistant\n\n"] * 20
    tokenizer = build_tokenizer(texts)
    tokenizer.save_pretrained(str(out / "model"), save_jinja_files=False)   # the template in tokenizer_config.json
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      **MODEL_SHAPE)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out / "model"))
    for name, part in (("train", conversations[:train]), ("valid", conversations[train:])):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in part)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.chat.sample",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("out", help="folder to write model/, train.jsonl and valid.jsonl into")
    parser.add_argument("--train", type=int, default=64, help="training conversations")
    parser.add_argument("--valid", type=int, default=16, help="validation conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_chat_sample(Path(args.out), args.train, args.valid, args.seed)
    print(f"wrote {args.out}/model/ (a random tiny Llama and its chat tokenizer), train.jsonl and valid.jsonl")


if __name__ == "__main__":
    main()
