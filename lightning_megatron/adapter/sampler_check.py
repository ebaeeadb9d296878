"""A user's own ``DistributedSampler`` must shard by data-parallel rank, not by global rank.

Lightning keeps a ``DistributedSampler`` the user built (it only adds one to loaders without it). The DDP
idiom ``DistributedSampler(dataset)`` splits the data over the whole world, which under tensor, context or
pipeline parallelism gives peers that must read the same samples different ones: the run trains on
mismatched activations without any error. This finds such a sampler; the strategy raises on every rank.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.utils.data import DistributedSampler


def _distributed_sampler(dataloader: Any) -> Optional[DistributedSampler]:
    for sampler in (getattr(dataloader, "sampler", None), getattr(getattr(dataloader, "batch_sampler", None),
                                                                      "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def sampler_shards_wrongly(dataloader: Any, num_replicas: int, rank: int) -> bool:
    """Whether ``dataloader`` holds a ``DistributedSampler`` whose replicas or rank are not the strategy's
    data-parallel ones (``num_replicas``, ``rank``: ``strategy.distributed_sampler_kwargs``)."""
    sampler = _distributed_sampler(dataloader)
    return sampler is not None and (sampler.num_replicas != num_replicas or sampler.rank != rank)


def wrong_sampler_message(dataloader: Any, stage: str, num_replicas: int) -> str:
    """The error every rank raises (the same text on every rank: nothing rank-specific in it)."""
    sampler = _distributed_sampler(dataloader)
    found = f"DistributedSampler(num_replicas={sampler.num_replicas}, ...)" if sampler is not None else \
        "DistributedSampler"
    return (f"The {stage} DataLoader has a {found} that does not shard by data-parallel rank on every rank: "
            f"MegatronStrategy has {num_replicas} data-parallel replica(s), and tensor-, context- and "
            f"pipeline-parallel peers must read the same samples (or they silently train on different ones). "
            f"Leave the sampler to Lightning (a plain DataLoader: the Trainer adds the right DistributedSampler), "
            f"or build it with DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs).")
