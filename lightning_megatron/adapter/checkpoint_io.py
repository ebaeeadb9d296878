"""How the megatron strategy writes its checkpoint folders, said the way Lightning users say it: a checkpoint-io plugin.

``MegatronStrategy`` writes sharded folders itself (every rank its own shards), so no ``CheckpointIO`` writes for it;
the plugins carry the options. ``Trainer(plugins=[AsyncCheckpointIO()])`` (Lightning's own) makes saves during fit
go on in the background; ``ShardedCheckpointIO(checksums=True)`` writes a crc32 of every stored item, checked at
every load; ``AsyncCheckpointIO(ShardedCheckpointIO(checksums=True))`` does both.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO


class ShardedCheckpointIO(CheckpointIO):
    """Options of the megatron strategy's sharded checkpoints (it reads and writes the folders itself).

    Args:
        checksums: write a crc32 of every tensor piece and object into ``<shard file>.crc32`` at save; a load then
            raises ``CorruptCheckpointError`` naming the file and tensor whose bytes changed on disk. Off by default:
            on CPU it added 15-30% to save + load time, a load from the page cache running at memory speed while
            crc32 hashes ~1.8 GB/s (``benchmarks/bench_checkpoint_checksums.py``, 770 MiB state). Folders that
            have the files are checked whatever this says.
    """

    def __init__(self, checksums: bool = False) -> None:
        if not isinstance(checksums, bool):
            raise TypeError(f"ShardedCheckpointIO(checksums={checksums!r}): pass True or False.")
        self.checksums = checksums

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        raise RuntimeError(_ONLY_OPTIONS)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        raise RuntimeError(_ONLY_OPTIONS)

    def remove_checkpoint(self, path: Any) -> None:
        raise RuntimeError(_ONLY_OPTIONS)


_ONLY_OPTIONS = ("ShardedCheckpointIO only carries options of MegatronStrategy's sharded checkpoints; the strategy "
                 "reads and writes the folders (trainer.save_checkpoint, ModelCheckpoint, fit(ckpt_path=...)).")


def save_options(checkpoint_io: Optional[CheckpointIO]) -> Tuple[bool, bool]:
    """``(in the background, with checksums)`` as the strategy's checkpoint-io plugin(s) ask."""
    background, io = False, checkpoint_io
    while io is not None:
        background = background or isinstance(io, AsyncCheckpointIO)
        if isinstance(io, ShardedCheckpointIO):
            return background, io.checksums
        io = io.checkpoint_io if isinstance(io, _WrappingCheckpointIO) else None
    return background, False
