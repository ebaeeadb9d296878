"""What the strategy does to the Trainer's data loaders and to what the predict loop collected."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from ..engine.microbatches import ragged_last_batch
from ..engine.replicas import in_dataset_order
from ..parallel import ParallelState
from .resumable_loader import ResumableLoader
from .sampler_check import sampler_shards_wrongly, wrong_sampler_message


def prepare_dataloader(dataloader: Any, trainer: Optional[Any], shards: Dict[str, int],
                       micro_batch_size: Optional[int], any_rank: Callable[[bool], bool]) -> Any:
    """A user's DistributedSampler must shard by data-parallel rank (``shards``: the sampler arguments; decided
    with ``any_rank``, so every rank raises); training loaders resume mid-epoch exactly (Lightning alone replays
    the epoch's batches), and a last batch that ``micro_batch_size`` cannot split is announced now."""
    if any_rank(sampler_shards_wrongly(dataloader, **shards)):
        stage = trainer.state.stage.value if trainer is not None and trainer.state.stage else "evaluation"
        raise ValueError(wrong_sampler_message(dataloader, stage, shards["num_replicas"]))
    if trainer is None or trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
        return dataloader
    last = ragged_last_batch(dataloader, micro_batch_size)
    if last is not None:   # raised at that step; said now, before an epoch of work
        rank_zero_warn(f"The last training batch of every epoch holds {last} samples per data-parallel rank, which "
                       f"micro_batch_size={micro_batch_size} does not divide: that step will be refused. Set "
                       "drop_last=True on the DataLoader, or a batch size whose remainder it divides.")
    return ResumableLoader(dataloader, current_epoch=lambda: trainer.current_epoch)


def order_predictions(trainer: Any, state: ParallelState) -> None:
    """The predictions of every data-parallel rank, put back in dataset order on every rank (in place)."""
    loop = trainer.predict_loop
    if state.dp_size == 1 or not loop.return_predictions:
        return
    loaders = trainer.predict_dataloaders
    for index, batches in enumerate(loop._predictions):
        total = len((loaders[index] if isinstance(loaders, (list, tuple)) else loaders).dataset)
        ordered = in_dataset_order(batches, state, total)
        if ordered is None:
            rank_zero_warn("predict_step returned something other than tensors (in dicts, tuples or lists) with the "
                           "batch as their first dimension: under data parallelism each rank returns its own "
                           "samples' predictions, not the whole dataset's in order. Return tensors for that.")
        else:
            batches[:] = ordered
