"""Train the GPT recipe under MegatronStrategy on GPUs (NCCL) and print every step's loss.

Run once per layout and compare the printed losses (float32: equal to ~1e-5 across layouts):

    python benchmarks/gpu_strategy_check.py --devices 1
    python benchmarks/gpu_strategy_check.py --devices 2 --tp 2
    python benchmarks/gpu_strategy_check.py --devices 2 --pp 2 --micro-batch-size 4
    python benchmarks/gpu_strategy_check.py --devices 2 --tp 2 --cuda-graph partial
    python benchmarks/gpu_strategy_check.py --devices 1 --experts 8
    python benchmarks/gpu_strategy_check.py --devices 2 --experts 8 --ep 2 --spare 1
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

from lightning_megatron import MegatronStrategy
from lightning_megatron.moe import MoEConfig
from lightning_megatron.recipes.pretrain import GPTPretraining, PatternTokens


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses, self.start = [], None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.start is None and batch_idx == 2:
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--compile-layers", default="auto", choices=["auto", "0", "1"],
                        help="the strategy's compile_layers: auto, False (0) or True (1)")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--cuda-graph", default=None, choices=[None, "partial", "full"])
    parser.add_argument("--experts", type=int, default=0, help="MoE MLPs on every second layer (0: dense)")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--spare", type=int, default=0, help="ECHO spare expert slots per EP rank")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    dp = args.devices // (args.tp * args.pp * args.cp)
    moe = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=args.experts, topk=2, aux_loss_coeff=1e-2,
                    num_spare_experts_per_ep_rank=args.spare) if args.experts else None
    module = GPTPretraining(vocab_size=512, seq_length=128, num_layers=4, hidden_size=256, num_attention_heads=8,
                            moe=moe, moe_layer_freq=2)
    data = PatternTokens(vocab_size=512, seq_length=128, batch_size=args.global_batch // dp, train_size=4096)
    recorder = Recorder()
    strategy = MegatronStrategy(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                micro_batch_size=args.micro_batch_size, cuda_graph=args.cuda_graph,
                                virtual_pipeline_model_parallel_size=args.vpp, expert_model_parallel_size=args.ep,
                                context_parallel_size=args.cp,
                                compile_layers={"0": False, "1": True}.get(args.compile_layers, "auto"))
    trainer = L.Trainer(accelerator="gpu", devices=args.devices, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[recorder])
    trainer.fit(module, data)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - recorder.start
    if trainer.is_global_zero:
        steps = len(recorder.losses) - 2
        print(f"layout devices={args.devices} tp={args.tp} pp={args.pp} cp={args.cp} ep={args.ep} experts={args.experts} "
              f"compile_layers={args.compile_layers} "
              f"spare={args.spare} mbs={args.micro_batch_size} "
              f"precision={args.precision} cuda_graph={args.cuda_graph} backend={torch.distributed.get_backend()} "
              f"{steps * args.global_batch * 128 / elapsed:.0f} tokens/s")
        print("losses " + " ".join(f"{l:.6f}" for l in recorder.losses), flush=True)


if __name__ == "__main__":
    main()
