"""A training DataLoader that resumes where the interrupted run stopped, not at the epoch's start.

Lightning restores the loop counters from a checkpoint but restarts a plain DataLoader's epoch, so
a run resumed mid-epoch trains again on the batches it had already used. Lightning saves and
restores the state of any loader that has ``state_dict``/``load_state_dict``: this wrapper records
how many batches of which epoch it handed out and, after a restore into that same epoch, skips
them. The sampler's order is a function of the epoch (``set_epoch``), so the skipped batches are
exactly the ones already trained on.

Resuming mid-epoch also builds a DataLoader iterator that the uninterrupted run never built at that
point, and building one draws its base seed from the global torch generator. That draw would shift
every later random number (dropout masks) away from the uninterrupted run's, so the iterator of a
resumed epoch is built with the generator's state put back afterwards.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import torch


class ResumableLoader:
    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._epoch: Optional[int] = None     # the sampler's epoch of the current iteration
        self._yielded = 0                     # batches of that epoch handed out so far
        self._resume: Optional[Dict[str, Any]] = None

    def __len__(self) -> int:
        return len(self.loader)

    def _sampler_epoch(self) -> Optional[int]:
        for sampler in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            epoch = getattr(sampler, "epoch", None)
            if epoch is None:
                epoch = getattr(getattr(sampler, "sampler", None), "epoch", None)
            if epoch is not None:
                return int(epoch)
        return None

    def __iter__(self) -> Iterator[Any]:
        self._epoch = self._sampler_epoch()
        skip = 0
        if self._resume is not None and self._resume.get("epoch") == self._epoch:
            skip = int(self._resume.get("batches", 0))
        self._resume = None
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
