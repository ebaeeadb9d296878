"""The chat recipe against a plain PyTorch loop over the same Hugging Face Qwen2 model, on one GPU (issue #29).

Both sides train the same random Qwen2.5-0.5B-shaped checkpoint (written here with ``save_pretrained``, no
download: 24 layers, hidden 896, 14 heads, 2 kv heads, SwiGLU 4864, q/k/v biases, tied 151936-token vocabulary,
rope base 1e6) on the same packed rows in the same order: random conversations through a locally trained
byte-level BPE tokenizer with a Llama-3-style chat template (``recipes/chat/sample.py``), written to JSONL and
packed by ``ChatData`` itself (``--seq`` tokens a row, labels only on assistant tokens, ``position_ids``
restarting per conversation, ``document_ids``). The plain loop draws its rows in the order Lightning feeds ours
(a shuffling ``DistributedSampler``, seed 0, epoch 0), so both train on the same rows step by step.

- ``ours``: ``recipes.chat.ChatFinetuning(pretrained=FOLDER)`` through ``Trainer(strategy=MegatronStrategy(
  calculate_per_token_loss=True, micro_batch_size=--micro-batch), precision="bf16-true")``, layers compiled as
  ``compile_layers="auto"`` does on CUDA; attention inside each conversation (FlexAttention block mask).
  ``ours-eager`` (not run by default): ``compile_layers=False``.
- ``plain``: ``AutoModelForCausalLM.from_pretrained(FOLDER, dtype=bf16, attn_implementation="sdpa")`` in a
  hand-written loop: per micro-batch, forward on the packed rows with their ``position_ids`` (transformers
  detects the packing and masks attention to each conversation, as its packing-with-flattening collator
  relies on: a dense ``[b, 1, s, s]`` boolean mask, so SDPA's memory-efficient kernel, not flash), the loss
  on float32 logits summed over the assistant tokens and divided by the whole step's assistant-token count
  (what ``calculate_per_token_loss`` computes, and HF's ``num_items_in_batch``), ``backward``; then
  ``optimizer.step()`` and ``zero_grad``.
- ``plain-compiled``: the same with ``torch.compile`` on each decoder layer.

Same tokens per optimizer step (``--rows`` 16 rows of ``--seq`` 2048 tokens in micro-batches of
``--micro-batch`` 4: ours splits the batch, the plain loop accumulates; 4 warm-up + 8 timed steps), bf16
parameters, fused AdamW (lr 1e-5, betas 0.9/0.95, no weight decay, no schedule: ``ChatFinetuning``'s
``configure_optimizers`` is overridden only to make its AdamW fused and drop its warm-up/decay), no clipping.
Each configuration runs in its own process; a step's time is the wall time over the timed steps between two
``cuda.synchronize`` (the warm-up steps compile). tokens/s counts every row position (padding included).
Ratio = plain_ms / x_ms. The step-0 losses (same weights, same rows) must agree to bf16 noise.

    PYTHONPATH=$PWD python benchmarks/bench_chat.py                              # ours, plain, plain-compiled
    PYTHONPATH=$PWD python benchmarks/bench_chat.py --configs ours,ours-eager,plain
    PYTHONPATH=$PWD python benchmarks/bench_chat.py --tiny --accelerator cpu     # plumbing on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from isolated import print_result, run_isolated   # benchmarks/isolated.py

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY = dict(QWEN_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
CONFIGS = ("ours", "plain", "plain-compiled")
IGNORE_INDEX = -100


# -- the data and checkpoint, written once by the parent process ---------------------------------------------
def _conversation(rng: random.Random, words: List[str], scale: float) -> List[Dict[str, str]]:
    """A system prompt (half the time), then 1-3 user/assistant turns of random lengths: at --seq 2048 they
    run ~100-1700 tokens (~600 on average: ~4.5 tokens a random word), so a row packs a few conversations."""
    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(rng.randint(lo, hi) * scale))))

    messages = [{"role": "system", "content": text(5, 20)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": text(3, 30)}, {"role": "assistant", "content": text(5, 90)}]
    return messages


def prepare(folder: Path, shape: Dict[str, Any], rows: int, seq: int, dtype: torch.dtype) -> None:
    """``folder``: the random Qwen2 checkpoint with its chat tokenizer, and ``train.jsonl`` holding enough
    conversations for ``rows`` packed rows."""
    import transformers

    from lightning_megatron.recipes.chat.sample import build_tokenizer

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(400)]
    scale = seq / 2048
    tokenizer = build_tokenizer([m["content"] for _ in range(200) for m in _conversation(rng, words, scale)]
                                + ["system user assistant\n\n"] * 20)
    conversations, total = [], 0
    while total < 1.1 * rows * seq:   # ~10% to spare: best-fit packing leaves a little padding per row
        messages = _conversation(rng, words, scale)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        conversations.append(messages)
        total += min(len(ids), seq)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in conversations)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)
    config = transformers.Qwen2Config(**shape, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # initialise in the training dtype: both sides load the very same weights
    try:
        transformers.Qwen2ForCausalLM(config).save_pretrained(str(folder))
    finally:
        torch.set_default_dtype(default)


def chat_data(args: argparse.Namespace) -> Any:
    """The recipe's ``ChatData`` over the written conversations."""
    from lightning_megatron.recipes.chat import ChatData

    return ChatData(train_files=[str(Path(args.data) / "train.jsonl")], tokenizer=args.data, seq_length=args.seq,
                    batch_size=args.rows)


# -- one configuration in this process ----------------------------------------------------------------------
def run_ours(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    import lightning as L

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.recipes.chat import ChatFinetuning
    from lightning_megatron.recipes.finetune.optim import param_groups

    cuda = args.accelerator == "gpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    last = args.warmup + args.steps - 1
    marks: Dict[Any, float] = {}
    losses: List[torch.Tensor] = []

    class Chat(ChatFinetuning):
        def configure_optimizers(self) -> torch.optim.Optimizer:   # the recipe's AdamW, fused, without schedule
            h = self.hparams
            return torch.optim.AdamW(param_groups(self, h.weight_decay), lr=h.lr, betas=tuple(h.adam_betas),
                                     eps=h.adam_eps, fused=cuda)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i in (0, args.warmup):
                sync()
                marks[i] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append(outputs["loss"].detach())   # the step's mean over its assistant tokens
            if i == last:
                sync()
                marks["end"] = time.perf_counter()

    strategy = MegatronStrategy(calculate_per_token_loss=True, micro_batch_size=args.micro_batch,
                                compile_layers=False if name == "ours-eager" else "auto")
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy,
                        precision="bf16-true" if cuda else "32-true", max_steps=last + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()])
    trainer.fit(Chat(pretrained=args.data), datamodule=chat_data(args))
    return {"marks": marks, "losses": [float(x) for x in losses]}


def run_plain(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoModelForCausalLM

    cuda = args.accelerator == "gpu"
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = AutoModelForCausalLM.from_pretrained(args.data, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.train()
    if name == "plain-compiled":
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  fused=cuda)
    data = chat_data(args)
    data.setup("fit")
    rows = data.train_dataloader().dataset
    # the order Lightning gives ours: under a distributed strategy it samples training rows with a shuffling
    # DistributedSampler seeded by PL_GLOBAL_SEED (0 unset), epoch 0
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", "0")))
    last = args.warmup + args.steps - 1
    marks: Dict[Any, float] = {}
    losses: List[torch.Tensor] = []
    for i, batch in enumerate(DataLoader(rows, batch_size=args.rows, sampler=sampler, drop_last=True)):
        if i in (0, args.warmup):
            sync()
            marks[i] = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        count = (batch["labels"] != IGNORE_INDEX).sum()   # the step's assistant tokens (stays on the device)
        total = torch.zeros((), device=device)
        for at in range(0, args.rows, args.micro_batch):
            ids, pos, labels = (batch[k][at:at + args.micro_batch] for k in ("input_ids", "position_ids", "labels"))
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            # labels are already shifted (ChatData: position t is labelled with token t + 1), so no HF shift
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / count
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if i == last:
            sync()
            marks["end"] = time.perf_counter()
            break
    return {"marks": marks, "losses": [float(x) for x in losses]}


def run_one(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(0)
    out = (run_ours if name.startswith("ours") else run_plain)(name, args)
    marks, losses = out["marks"], out["losses"]
    if "end" not in marks:
        raise RuntimeError(f"{name} ran {len(losses)} steps, not {args.warmup + args.steps}: too few packed rows.")
    step_s = (marks["end"] - marks[args.warmup]) / args.steps
    cuda = args.accelerator == "gpu"
    return {"step_ms": step_s * 1e3, "tokens_per_s": args.rows * args.seq / step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "warmup_s": marks[args.warmup] - marks[0], "first_loss": losses[0], "last_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS), help="of ours, ours-eager, plain, plain-compiled")
    parser.add_argument("--only", help="one configuration, in this process")
    parser.add_argument("--data", help="(--only) the folder the parent wrote")
    parser.add_argument("--seq", type=int, default=None, help="tokens a packed row (2048; --tiny 128)")
    parser.add_argument("--rows", type=int, default=16, help="rows per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (4; --tiny 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (8; --tiny 2)")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, float32 (plumbing)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip configurations past this")
    args = parser.parse_args()
    args.seq = args.seq or (128 if args.tiny else 2048)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 4)
    args.steps = args.steps or (2 if args.tiny else 8)
    if args.rows % args.micro_batch:
        parser.error("--rows must be a multiple of --micro-batch")
    if args.only:
        print_result(run_one(args.only, args))
        return
    start = time.perf_counter()
    shape = TINY if args.tiny else QWEN_05B
    cuda = args.accelerator == "gpu"
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device: {device}  torch {torch.__version__}  Qwen2 {'tiny' if args.tiny else '0.5B'} shape  "
          f"{args.rows} rows x {args.seq} tokens a step (micro-batches of {args.micro_batch})  "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_chat_") as folder:
        prepare(Path(folder), shape, args.rows * (args.warmup + args.steps), args.seq,
                torch.bfloat16 if cuda else torch.float32)
        print(f"wrote the checkpoint and conversations in {time.perf_counter() - start:.0f} s", flush=True)
        for name in args.configs.split(","):
            left = args.budget_s - (time.perf_counter() - start)
            if left < 20:
                print(f"{name}: SKIPPED (budget)", flush=True)
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--only", name, "--data", folder, "--seq", str(args.seq),
                   "--rows", str(args.rows), "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--accelerator", args.accelerator]
            began = time.perf_counter()
            r = run_isolated(name, cmd, left)
            if r is None:
                continue
            results[name] = r
            print(f"{name}: {r['step_ms']:.1f} ms/step  {r['tokens_per_s']:,.0f} tokens/s  peak {r['peak_gib']:.1f} GiB"
                  f"  loss step 0 {r['first_loss']:.5f}, step {args.warmup + args.steps - 1} {r['last_loss']:.5f}"
                  f"  (warm-up {r['warmup_s']:.0f} s, process {time.perf_counter() - began:.0f} s)", flush=True)
    base = results.get("plain")
    print("\n| configuration | step ms | tokens/s | peak GiB | loss step 0 | loss last step | speed vs plain |\n"
          "|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{base['step_ms'] / r['step_ms']:.3f}x" if base else "-"
        print(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} | "
              f"{r['first_loss']:.5f} | {r['last_loss']:.5f} | {ratio} |")
    if "ours" in results and base:
        print(f"\nstep-0 loss: ours {results['ours']['first_loss']:.5f}, plain {base['first_loss']:.5f} "
              f"(difference {abs(results['ours']['first_loss'] - base['first_loss']):.2e})")
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
