"""The strategy's checkpoint hooks: sharded folders through ``checkpoint/trainer_state.py``.

Sharded (torch.distributed.checkpoint, reshardable across TP/PP/VPP/DP/EP) with or without the distributed
optimizer: each optimizer is read and written as the plain optimizer over the whole model. Lightning's
own model and optimizer state dicts are left empty: ``save_checkpoint`` writes every shard itself.
With Lightning's ``AsyncCheckpointIO`` plugin, saves during fit are written in the background
(``checkpoint/background.py``): the next save, the end of fit and teardown wait for the write and raise its
error; an older checkpoint that ``ModelCheckpoint`` drops is deleted only once the newer one committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from ..checkpoint.background import BackgroundSaver
from ..checkpoint.trainer_state import (load_trainer_checkpoint, loaded_in_place, remove_checkpoint_path,
                                        save_trainer_checkpoint)
from ..distributed import FullOptimizerView
from ..distributed.gradients import GradientState, checkpoint_views
from ..parallel import ParallelState
from ..tensor_parallel.random import get_rng_tracker
from .checkpoint_io import save_options


class ShardedCheckpointHooks(ParallelStrategy):
    """Mixed into ``MegatronStrategy``: reads ``gradients`` (where the optimizer state lives), the process
    groups (``_state()``) and, after fit, the optimizer states gathered before the groups went."""

    gradients: Optional[GradientState]
    _final_optimizer_states: Dict[int, FullOptimizerView]
    _background: Optional[BackgroundSaver] = None   # the writer of background saves (made at the first one)
    _fitting = False    # between on_train_start and on_train_end: saves may go on in the background
    _reserved: frozenset = frozenset()   # optimizers (ids) stepped in this fit (their background-save buffers made)

    if TYPE_CHECKING:   # what the strategy provides
        def _state(self) -> ParallelState: ...

        def finish_param_sync(self) -> None: ...

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._fitting = True

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """After the first optimizer step of fit with background saves (``AsyncCheckpointIO``), the host buffers
        the saves copy into are made (its state exists then; once per optimizer): the first save no longer pays
        ``cudaHostAlloc`` for the whole state while training waits (seconds for gigabytes)."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._fitting and id(optimizer) not in self._reserved:   # once per optimizer and fit
            self._reserved = self._reserved | {id(optimizer)}
            if save_options(self.checkpoint_io)[0]:
                if self._background is None:
                    self._background = BackgroundSaver()
                assert self.lightning_module is not None
                self._background.reserve([self.lightning_module], self._checkpoint_optimizers(saving=True))
        return out

    @override
    def on_train_end(self) -> None:
        """The last background save is finished (its error raised). The process groups go with ``teardown``: keep the
        whole optimizer state (host memory) for a ``trainer.save_checkpoint`` after ``fit``."""
        self._fitting, self._reserved = False, frozenset()
        if self._background is not None:
            self._background.wait()
        self.finish_param_sync()
        if self.gradients is not None:
            self._final_optimizer_states = self.gradients.gather_optimizer_states()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded loading reads straight into the parameters and optimizers: they must exist."""
        return True

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        self.finish_param_sync()
        return {}   # save_checkpoint writes the parameters shard by shard

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if loaded_in_place(checkpoint):
            return   # load_checkpoint already read every shard into place
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.gradients is not None:
            self.gradients.reload_main_params()

    @override
    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        return {}   # save_checkpoint writes the optimizer state shard by shard

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not loaded_in_place(checkpoint):
            raise ValueError("the megatron strategy loads its own sharded checkpoint folders (load_checkpoint) only.")

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A sharded folder written by every rank; it resumes at any layout."""
        background, checksums = save_options(self.checkpoint_io)
        if background and self._fitting and self._background is None:
            self._background = BackgroundSaver()
        save_trainer_checkpoint(self.broadcast(str(filepath)), checkpoint, [self.lightning_module],
                                self._checkpoint_optimizers(saving=True), get_rng_tracker(self._state()),
                                checksums=checksums, background=self._background if self._fitting else None)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """A sharded folder (from any layout), read into place; optimizer states only when fitting."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        return load_trainer_checkpoint(str(self.broadcast(str(checkpoint_path))), [self.lightning_module],
                                       self._checkpoint_optimizers(saving=False) if fitting else None,
                                       get_rng_tracker(self._state()), strict=self.lightning_module.strict_loading)

    def _raw_optimizers(self) -> List[Any]:
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]

    def _checkpoint_optimizers(self, saving: bool) -> List[Any]:
        sharded = self.gradients.distributed_optimizer if self.gradients is not None else None
        return checkpoint_views(self._raw_optimizers(), saving, sharded, self._final_optimizer_states)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            if self._background is not None:   # once the save in flight is whole
                self._background.after_save(lambda: remove_checkpoint_path(filepath))
            else:
                remove_checkpoint_path(filepath)

    @override
    def teardown(self) -> None:
        """Wait for a background save still in flight (raising its error), then Lightning's teardown."""
        self._fitting = False
        background, self._background = self._background, None
        try:
            if background is not None:
                background.close()
        finally:
            super().teardown()
