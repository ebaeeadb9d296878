"""CUDA graphs through MegatronStrategy: eager vs cuda_graph="partial" vs "full", side by side.

- ``--model bert``: BERT-base sequence classifier (12 layers, hidden 768), micro-batch 4, sequence 128,
  dropout 0.1 (launch-bound on one GPU), synthetic MNLI-shaped batches.
- ``--model gpt-moe``: a small GPT whose MLPs are MoE layers (8 experts, top-2, padded capacity so
  shapes are static), dropout 0.1.
- ``--model gpt --pp 2 --microbatches N``: a small GPT under PP=2 on 2 GPUs, partial graphs: prints
  the memory the graphs hold, to compare N=8 with N=16.

Prints each step's loss and the median step time after the capture (20 steps).

    python benchmarks/bench_graphs_strategy.py --model bert --cuda-graph {none,partial,full}
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_megatron import MegatronStrategy


class Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int, classes: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, vocab, (n, seq + 1), generator=gen)
        self.labels = torch.randint(0, classes, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i, :-1], "next": self.ids[i, 1:], "labels": self.labels[i]}


class Module(L.LightningModule):
    def __init__(self, kind: str, vocab: int, seq: int) -> None:
        super().__init__()
        self.kind, self.vocab, self.seq = kind, vocab, seq
        self.losses, self.times = [], []

    def configure_model(self) -> None:
        from lightning_megatron.models import BertForSequenceClassification, GPTModel
        from lightning_megatron.moe import MoEConfig
        from lightning_megatron.pipeline import VirtualChunks
        from lightning_megatron.transformer import TransformerConfig

        if self.kind == "bert":
            cfg = TransformerConfig(num_layers=12, hidden_size=768, num_attention_heads=12, layernorm_order="post",
                                    attn_mask_type="padding", hidden_dropout=0.1, attention_dropout=0.1)
            self.model = BertForSequenceClassification(cfg, self.vocab, 3)
        else:
            moe = (MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, topk=2, capacity_factor=2.0,
                             pad_to_capacity=True) if self.kind == "gpt-moe" else None)
            cfg = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, hidden_dropout=0.1,
                                    attention_dropout=0.1, moe=moe, moe_layer_freq=2)
            self.model = VirtualChunks(lambda v: GPTModel(cfg, self.vocab, self.seq, vp_rank=v))

    def forward(self, batch):
        if self.kind == "bert":
            return self.model(batch["input_ids"])
        return self.model(batch["input_ids"], labels=batch["next"])

    def training_step(self, batch, batch_idx):
        out = self(batch)
        return F.cross_entropy(out.float(), batch["labels"]) if self.kind == "bert" else out.mean()

    def on_train_batch_start(self, *args):
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs, *args):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self):
        graphs = self.trainer.strategy.engine.partial_graphs
        self.graph_stats = graphs.stats() if graphs is not None else None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["bert", "gpt", "gpt-moe"], required=True)
    parser.add_argument("--cuda-graph", choices=["none", "partial", "full"], default="none")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    seq, vocab = 128, 30522 if args.model == "bert" else 1024
    batch = args.micro_batch_size * args.microbatches
    graph = None if args.cuda_graph == "none" else args.cuda_graph
    strategy = MegatronStrategy(pipeline_model_parallel_size=args.pp, cuda_graph=graph,
                                micro_batch_size=args.micro_batch_size if args.microbatches > 1 else None)
    module = Module(args.model, vocab, seq)
    trainer = L.Trainer(accelerator="gpu", devices=args.pp, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(Tokens(batch * args.steps, seq, vocab, 3), batch_size=batch, drop_last=True)
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, data)
    if trainer.is_global_zero:
        stats = module.graph_stats
        held = ""
        if stats is not None:
            held = f" graphs={stats['graphs']} static_slots={stats['static_input_slots']}"
        print(f"RESULT model={args.model} cuda_graph={args.cuda_graph} pp={args.pp} microbatches={args.microbatches} "
              f"median_step_ms={statistics.median(module.times[3:]) * 1e3:.2f} "
              f"peak_GiB={torch.cuda.max_memory_allocated() / 2**30:.3f}{held}", flush=True)
        print("losses " + " ".join(f"{l:.5f}" for l in module.losses), flush=True)


if __name__ == "__main__":
    main()
