"""A training DataLoader that resumes where the interrupted run stopped, not at the epoch's start.

Lightning restores the loop counters from a checkpoint but restarts a plain DataLoader's epoch, so
a run resumed mid-epoch trains again on the batches it had already used. Lightning saves and
restores the state of any loader that has ``state_dict``/``load_state_dict``: this wrapper records
how many batches of which epoch it handed out and, after a restore into that same epoch, skips
them. The skipped batches are exactly the ones already trained on when the order is a function of the
epoch: a sampler with ``set_epoch`` (Lightning's ``DistributedSampler``) or a sequential one. Any other
loader (an ``IterableDataset``, your own shuffling sampler) restarts the epoch with a warning, as Lightning
does without this wrapper; so does an epoch that Lightning left unfinished (``max_steps`` stopped it and
Lightning counts it as done).

Resuming mid-epoch also builds a DataLoader iterator that the uninterrupted run never built at that
point, and building one draws its base seed from the global torch generator. That draw would shift
every later random number (dropout masks) away from the uninterrupted run's, so the iterator of a
resumed epoch is built with the generator's state put back afterwards.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import SequentialSampler


class ResumableLoader:
    """``current_epoch``: the trainer's epoch, which fixes a sequential loader's iteration (its sampler has no
    epoch of its own)."""

    def __init__(self, loader: Any, current_epoch: Optional[Callable[[], int]] = None) -> None:
        self.loader = loader
        self.current_epoch = current_epoch
        self._epoch: Optional[int] = None   # the epoch that fixes the current iteration's order (_order_key)
        self._yielded = 0                     # batches of that epoch handed out so far
        self._resume: Optional[Dict[str, Any]] = None

    def __len__(self) -> int:
        return len(self.loader)

    def _order_key(self) -> Optional[int]:
        """The sampler's epoch when its order is a function of it, the trainer's for a sequential order,
        ``None`` when iterating again may give other batches (no resume by skipping)."""
        for sampler in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            for candidate in (sampler, getattr(sampler, "sampler", None)):
                epoch = getattr(candidate, "epoch", None)
                if epoch is not None:
                    return int(epoch)
        samplers = (getattr(self.loader, "sampler", None), getattr(getattr(self.loader, "batch_sampler", None),
                                                                    "sampler", None))
        if self.current_epoch is not None and any(isinstance(s, SequentialSampler) for s in samplers):
            return int(self.current_epoch())
        return None

    def _to_skip(self, key: Optional[int]) -> int:
        """Batches of this iteration already trained on before the checkpoint (warns when they cannot be)."""
        resume, self._resume = self._resume, None
        done = int(resume.get("batches", 0)) if resume is not None else 0
        try:
            total: Optional[int] = len(self.loader)
        except TypeError:   # an IterableDataset without __len__
            total = None
        if not done or (total is not None and done >= total):
            return 0   # nothing trained yet, or the saved epoch was complete: this one starts afresh
        assert resume is not None   # batches were done
        if key is not None and resume.get("epoch") == key:
            return done
        saved = resume.get("epoch")
        if key is None or saved is None:
            rank_zero_warn(f"Resuming {done} batches into an epoch of a loader whose order cannot be replayed (an "
                           "IterableDataset, or a sampler that is neither Lightning's DistributedSampler nor "
                           f"sequential): the epoch restarts from its first batch, so {done} batches are trained "
                           "again. Keep Lightning's DistributedSampler (use_distributed_sampler=True) for an exact "
                           "resume.")
        else:
            rank_zero_warn(f"The checkpoint was taken {done} batches into epoch {saved}, and Lightning resumes at "
                           f"epoch {key} (it counts an epoch that max_steps stopped as finished): the rest of epoch "
                           f"{saved} is not trained. Checkpoints taken while training (e.g. "
                           "ModelCheckpoint(every_n_train_steps=...)) resume exactly.")
        return 0

    def __iter__(self) -> Iterator[Any]:
        self._epoch = self._order_key()
        skip = self._to_skip(self._epoch)
        self._yielded = skip
        if skip:
            with torch.random.fork_rng(devices=[]):   # the CPU generator only: what the iterator draws from
                batches = iter(self.loader)
        else:
            batches = iter(self.loader)
        for index, batch in enumerate(batches):
            if index < skip:
                continue
            self._yielded += 1
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self._epoch, "batches": self._yielded}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._resume = dict(state)

    def __getattr__(self, name: str) -> Any:   # sampler, dataset, batch_size... for Lightning
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
