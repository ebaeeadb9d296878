"""MNLI fine-tuning throughput with BERT-large shapes on 2 GPUs: ours (TP=2) vs Hugging Face + Lightning DDP.

Both train a randomly initialised BERT-large (24 layers, hidden 1024, 16 heads, vocab 30522) sequence
classifier (3 labels) on synthetic MNLI-shaped batches (sequence 128, global batch 64), bf16-mixed,
AdamW, dropout as in BERT, for --steps steps after --warmup; samples/s from the timed steps.

    python benchmarks/bench_mnli.py --impl ours   # MegatronStrategy(tensor_model_parallel_size=2)
    python benchmarks/bench_mnli.py --impl hf     # transformers.BertForSequenceClassification, strategy="ddp"
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

SEQ, VOCAB, LABELS = 128, 30522, 3


class SyntheticMNLI(Dataset):
    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, VOCAB, (size, SEQ), generator=gen)
        self.types = (torch.arange(SEQ) >= SEQ // 2).long().expand(size, SEQ)
        self.labels = torch.randint(0, LABELS, (size,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "token_type_ids": self.types[i],
                "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.labels[i]}


class Ours(L.LightningModule):
    def configure_model(self) -> None:
        from lightning_megatron.models import BertForSequenceClassification
        from lightning_megatron.transformer import TransformerConfig

        config = TransformerConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                                   layernorm_order="post", attn_mask_type="padding", layernorm_epsilon=1e-12)
        self.model = BertForSequenceClassification(config, VOCAB, LABELS)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        return F.cross_entropy(logits.float(), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)


class HF(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, num_labels=LABELS, attn_implementation="sdpa")
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         token_type_ids=batch["token_type_ids"])
        return F.cross_entropy(out.logits.float(), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)


class Timer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.steps = warmup, None, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.warmup:
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.start is not None:
            self.steps += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ours", "hf"], required=True)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    if args.impl == "ours":
        from lightning_megatron import MegatronStrategy

        module, strategy, per_rank = Ours(), MegatronStrategy(tensor_model_parallel_size=2), args.global_batch
    else:
        module, strategy, per_rank = HF(), "ddp", args.global_batch // 2
    timer = Timer(args.warmup)
    trainer = L.Trainer(accelerator="gpu", devices=2, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    data = DataLoader(SyntheticMNLI(per_rank * 2 * (args.warmup + args.steps)), batch_size=per_rank, drop_last=True)
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, data)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - timer.start
    if trainer.is_global_zero:
        print(f"RESULT impl={args.impl} gpus=2 global_batch={args.global_batch} seq={SEQ} "
              f"{timer.steps * args.global_batch / elapsed:.1f} samples/s  "
              f"{elapsed / timer.steps * 1e3:.1f} ms/step  peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
              flush=True)


if __name__ == "__main__":
    main()
