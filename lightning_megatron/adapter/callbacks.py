"""Throughput, TFLOP/s per device, MFU and peak memory in the progress bar and loggers.

Why not Lightning's ``ThroughputMonitor``: it synchronizes the GPU after every batch, takes every rank
for a data-parallel replica (global samples = one rank's x world size, wrong under TP/PP/CP, which read
the same samples) and asks for FLOPs per device. This callback times whole windows of optimizer steps
(one device synchronize and two tiny all-reduces per window, none in between), counts the samples the
data-parallel ranks really read, and takes the model FLOPs of the whole model once.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

__all__ = ["PEAK_FLOPS", "PREFIX", "MegatronThroughputMonitor", "batch_counts", "peak_flops_per_device"]

PREFIX = "throughput/"
GIB = 2 ** 30

# Dense (no structured sparsity) peak FLOP/s per GPU from NVIDIA's data sheets: 16-bit (bf16/fp16 tensor
# cores), tf32, fp32. Matched on the lower-cased torch.cuda.get_device_name(), first hit wins.
PEAK_FLOPS: Tuple[Tuple[Tuple[str, ...], Dict[str, float]], ...] = (
    (("h200", "nvl"), {"16": 835.5e12, "tf32": 417.5e12, "32": 60e12}),
    (("h200",), {"16": 989.4e12, "tf32": 494.7e12, "32": 66.9e12}),
    (("h100", "nvl"), {"16": 835.5e12, "tf32": 417.5e12, "32": 60e12}),
    (("h100", "pcie"), {"16": 756e12, "tf32": 378e12, "32": 51.2e12}),
    (("h100",), {"16": 989.4e12, "tf32": 494.7e12, "32": 66.9e12}),   # SXM (HBM3)
    (("a100",), {"16": 312e12, "tf32": 156e12, "32": 19.5e12}),
)


def peak_flops_per_device(device: torch.device, precision: str) -> Optional[float]:
    """Dense peak FLOP/s of ``device`` at the Trainer's ``precision`` (``"bf16-mixed"``, ``"32-true"``...),
    or ``None`` when unknown (CPUs, GPUs missing from :data:`PEAK_FLOPS`, 64-bit)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    if "64" in precision:
        return None
    if "16" in precision:
        kind = "16"
    else:
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        kind = "tf32" if tf32 else "32"
    for words, peaks in PEAK_FLOPS:
        if all(word in name for word in words):
            return peaks[kind]
    return None


def batch_counts(batch: Any, input_key: str = "input_ids") -> Tuple[int, Optional[int]]:
    """``(samples, tokens)`` of one batch, read from tensor shapes only (no device sync).

    The tensor is ``batch[input_key]`` for a mapping, else the batch itself or its first tensor. Samples are
    its first dimension; tokens its number of elements when it holds token ids (an integer tensor of two or
    more dimensions: ``[b, s]``, RACE's ``[b, choices, s]``), padding included, else ``None``.
    """
    tensor = _find_tensor(batch, input_key)
    if tensor is None or tensor.dim() == 0:
        raise ValueError(f"MegatronThroughputMonitor found no batched tensor in the batch (input_key={input_key!r}): "
                         "pass the key of a [batch, ...] tensor as input_key.")
    tokens = tensor.numel() if tensor.dim() >= 2 and not tensor.is_floating_point() else None
    return int(tensor.shape[0]), tokens


def _find_tensor(batch: Any, key: str) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        if isinstance(batch.get(key), torch.Tensor):
            return batch[key]
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    for value in values:
        found = _find_tensor(value, key)
        if found is not None:
            return found
    return None


class MegatronThroughputMonitor(Callback):
    """Logs, every ``window`` optimizer steps, the rates measured over that window:

    - ``throughput/samples_per_sec``, ``throughput/tokens_per_sec``: global (all data-parallel ranks,
      ``accumulate_grad_batches`` included); tokens are the ``input_key`` tensor's elements, padding included;
    - ``throughput/step_time_sec``: seconds per optimizer step;
    - ``throughput/tflops_per_device``: the model's training FLOPs (forward + backward, counted once for the
      whole model, :mod:`lightning_megatron.transformer.flops`) per second, divided by the world size;
    - ``throughput/mfu``: that over the device's peak FLOP/s;
    - ``throughput/peak_memory_gib``: ``torch.cuda.max_memory_allocated`` (since the process started or the last
      ``torch.cuda.reset_peak_memory_stats``), the largest over the ranks (CUDA only).

    FLOPs come from the LightningModule's ``training_flops(batch) -> int`` (the model FLOPs of one forward
    and backward pass over this data-parallel rank's batch; the project's recipes define it); without it
    only samples, tokens and step time are logged. Every rank logs the same values (they are reduced over
    all ranks at the window's end), so any rank's logger, the progress bar and ``callback_metrics`` agree.
    The first optimizer step (warm-up, compilation) and validation are not timed.

    Args:
        window: optimizer steps per measurement; default the Trainer's ``log_every_n_steps`` (keep it a
            multiple of that, or loggers skip windows that end off their cadence).
        peak_flops: peak FLOP/s of one device for MFU; default looked up by GPU name and precision
            (:data:`PEAK_FLOPS`); on a CPU MFU is logged only when given.
        input_key: the batch entry whose shape gives samples and tokens.
        prog_bar: show tokens/s (or samples/s) and MFU in the progress bar.
    """

    def __init__(self, window: Optional[int] = None, peak_flops: Optional[float] = None,
                 input_key: str = "input_ids", prog_bar: bool = True) -> None:
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"MegatronThroughputMonitor(window={window!r}): window must be a positive number of "
                             "optimizer steps, or None for the Trainer's log_every_n_steps.")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not math.isfinite(peak_flops) or peak_flops <= 0):
            raise ValueError(f"MegatronThroughputMonitor(peak_flops={peak_flops!r}): peak_flops must be a positive "
                             "number of FLOP/s per device (e.g. 989e12 for an H100 SXM in bf16), or None.")
        if not isinstance(input_key, str):
            raise ValueError(f"MegatronThroughputMonitor(input_key={input_key!r}): input_key must be a string.")
        self.window, self.peak_flops, self.input_key, self.prog_bar = window, peak_flops, input_key, prog_bar
        self._window: Optional[int] = None
        self._peak: Optional[float] = None
        self._told_no_flops = False
        self._flops_fn: Optional[Callable[[Any], Optional[int]]] = None
        self._last_step = 0
        self._reset(None)

    def _reset(self, t0: Optional[float]) -> None:
        self._t0, self._paused, self._steps = t0, 0.0, 0
        self._samples, self._tokens, self._flops = 0, 0, 0
        self._counts_tokens, self._counts_flops = True, True
        self._val_start: Optional[float] = None

    @override
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        self._window = self.window or (getattr(trainer, "log_every_n_steps", None) or None)
        self._peak = self.peak_flops or peak_flops_per_device(trainer.strategy.root_device, str(trainer.precision))
        if self._peak is None and trainer.strategy.root_device.type == "cuda":
            rank_zero_info(f"MegatronThroughputMonitor: no peak FLOP/s known for "
                           f"{torch.cuda.get_device_name(trainer.strategy.root_device)!r} at precision "
                           f"{trainer.precision}; pass peak_flops= to log MFU.")

    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._reset(None)
        self._last_step = trainer.global_step
        flops = getattr(pl_module, "training_flops", None)
        self._flops_fn = flops if callable(flops) else None
        if self._flops_fn is None and not self._told_no_flops:
            self._told_no_flops = True
            rank_zero_info(f"MegatronThroughputMonitor: {type(pl_module).__name__} has no training_flops(batch) "
                           "method; logging samples/s and tokens/s without TFLOP/s or MFU.")

    @override
    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._window is None:
            return
        samples, tokens = batch_counts(batch, self.input_key)
        self._samples += samples
        if tokens is None:
            self._counts_tokens = False
        else:
            self._tokens += tokens
        flops = self._flops_fn(batch) if self._flops_fn is not None else None
        if flops is None:
            self._counts_flops = False
        else:
            self._flops += int(flops)
        if trainer.global_step == self._last_step:   # accumulating gradients: the optimizer step is to come
            return
        self._last_step = trainer.global_step
        if self._t0 is None:                         # the first step of this fit only starts the clock
            self._reset(self._now(trainer))
            return
        self._steps += 1
        if trainer.global_step % self._window == 0:
            self._log(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._t0 is not None and not trainer.sanity_checking:
            self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._val_start is not None:
            self._paused += time.perf_counter() - self._val_start
            self._val_start = None

    @staticmethod
    def _now(trainer: "L.Trainer") -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # once per window: the host clock then covers the queued work
        return time.perf_counter()

    def _log(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        assert self._t0 is not None   # the clock started at the first step
        now = self._now(trainer)
        device = trainer.strategy.root_device
        memory = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
        counts = [self._samples, self._tokens if self._counts_tokens else -1, self._flops if self._counts_flops else -1]
        (samples, tokens, flops), (elapsed, memory) = _reduce(trainer, counts, [now - self._t0 - self._paused, memory])
        steps = self._steps
        self._reset(now)
        if elapsed <= 0:
            return
        world = max(1, trainer.world_size)
        metrics = {"samples_per_sec": samples / elapsed, "step_time_sec": elapsed / steps}
        if tokens >= 0:
            metrics["tokens_per_sec"] = tokens / elapsed
        if flops >= 0:
            per_device = flops / elapsed / world
            metrics["tflops_per_device"] = per_device / 1e12
            if self._peak:
                metrics["mfu"] = per_device / self._peak
        if device.type == "cuda":
            metrics["peak_memory_gib"] = memory
        shown = {"tokens_per_sec" if "tokens_per_sec" in metrics else "samples_per_sec", "mfu"}
        for name, value in metrics.items():
            pl_module.log(PREFIX + name, value, on_step=True, on_epoch=False, batch_size=1,
                          prog_bar=self.prog_bar and name in shown)


def _reduce(trainer: "L.Trainer", sums: List[int], maxes: List[float]) -> Tuple[List[float], List[float]]:
    """``sums`` added over the data-parallel replicas (ranks that share a data shard, the tensor/pipeline/
    context-parallel peers, count it once: the world's sum divided by their number) and ``maxes`` maximized
    over all ranks, as Python floats; negative sums (unknown on some rank) stay negative."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in sums], [float(v) for v in maxes]
    device = trainer.strategy.root_device
    world = dist.get_world_size()
    # one all-reduce for the sums and for how many ranks could not count them, one for the maxima
    total = torch.tensor([max(v, 0) for v in sums] + [float(v < 0) for v in sums], dtype=torch.float64,
                         device=device)
    peak = torch.tensor(maxes, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    shared = world / _data_parallel_size(trainer, world)
    values = total.tolist()
    summed = [-1.0 if unknown else t / shared for t, unknown in zip(values[:len(sums)], values[len(sums):])]
    return summed, peak.tolist()


def _data_parallel_size(trainer: "L.Trainer", world: int) -> int:
    """How many different data shards the ranks read: the strategy's sampler replicas (the megatron strategy
    shards by data-parallel rank; DDP by rank)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", world))
