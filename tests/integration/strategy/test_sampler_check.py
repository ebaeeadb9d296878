"""A DataLoader with the user's own DistributedSampler: by global rank (the DDP idiom) under tensor or
pipeline parallelism it would feed peers different samples silently (it did, before the check); the strategy
raises the same error on every rank, naming the fix. Built from the strategy's ``distributed_sampler_kwargs``
it trains, reading what Lightning's own sampler gives."""

import lightning as L
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_megatron import MegatronStrategy
from lightning_megatron.testing import run_on_ranks
from helpers.strategy_utils import TinyGPT, TokenData


class _Seen(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch["input_ids"].clone())


class _Module(TinyGPT):
    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def train_dataloader(self):
        data = TokenData()
        if self.sampler == "lightning":
            return DataLoader(data, batch_size=4)
        if self.sampler == "global-rank":   # the DDP idiom: num_replicas = world, rank = global rank
            return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
        if self.sampler == "global-rank-batch-sampler":
            return DataLoader(data, batch_sampler=BatchSampler(DistributedSampler(data, shuffle=False), 4, False))
        kwargs = self.trainer.strategy.distributed_sampler_kwargs   # "data-parallel-rank"
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=0, **kwargs))


def _fit(strategy_kwargs, sampler):
    seen = _Seen()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MegatronStrategy(**strategy_kwargs), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[seen])
    try:
        trainer.fit(_Module(sampler))
    except ValueError as err:
        return str(err)
    return seen.batches


@pytest.mark.parametrize("layout", [dict(tensor_model_parallel_size=2),
                                    dict(pipeline_model_parallel_size=2, micro_batch_size=2)], ids=["tp2", "pp2"])
def test_a_sampler_by_global_rank_is_refused_on_every_rank(layout):
    out = run_on_ranks(_fit, 2, layout, "global-rank", timeout=180, init_process_group=False)
    for message in out:
        assert isinstance(message, str), "trained although peers read different samples"
        assert "DistributedSampler(num_replicas=2, ...) that does not shard by data-parallel rank" in message
        assert "**trainer.strategy.distributed_sampler_kwargs" in message
    assert out[0] == out[1]


def test_a_sampler_by_data_parallel_rank_trains_like_lightnings_own():
    ours = run_on_ranks(_fit, 2, dict(tensor_model_parallel_size=2), "data-parallel-rank", timeout=180,
                        init_process_group=False)
    lightning = run_on_ranks(_fit, 2, dict(tensor_model_parallel_size=2), "lightning", timeout=180,
                             init_process_group=False)
    for rank in range(2):   # both tp ranks read the same samples, and the same ones Lightning's sampler gives
        assert len(ours[rank]) == 2
        assert all(torch.equal(a, b) for a, b in zip(ours[rank], ours[0]))
        assert all(torch.equal(a, b) for a, b in zip(ours[rank], lightning[rank]))


def test_a_global_rank_sampler_inside_a_batch_sampler_is_replaced_by_lightning():
    """Lightning rebuilds a plain BatchSampler around its own DistributedSampler (the strategy's kwargs): the
    tp peers read the same samples, so nothing is refused."""
    out = run_on_ranks(_fit, 2, dict(tensor_model_parallel_size=2), "global-rank-batch-sampler", timeout=180,
                       init_process_group=False)
    assert all(isinstance(batches, list) and len(batches) == 2 for batches in out), out
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))


def test_a_sampler_by_global_rank_is_right_under_pure_data_parallelism():
    out = run_on_ranks(_fit, 2, dict(), "global-rank", timeout=180, init_process_group=False)
    assert all(isinstance(batches, list) and len(batches) == 2 for batches in out)
    assert not torch.equal(out[0][0], out[1][0])   # the two replicas read different samples
