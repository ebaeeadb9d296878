"""The checkpoint folder's life: staged under a temporary name, renamed into place when whole.

Every rank writes into ``<path>.incomplete``; only after DCP has written ``.metadata`` (which it
does once every rank's files are written) and a barrier does rank 0 rename it to ``<path>``.
A save that dies half-way leaves at most the ``.incomplete`` folder, which does not end in the
name a ``ModelCheckpoint`` looks for and which ``check_folder`` refuses to load; an older
checkpoint at ``<path>`` stays untouched until the new one is complete.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Optional

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .collective import agree, barrier, rank
from .errors import IncompleteCheckpointError

STAGING_SUFFIX = ".incomplete"
_REPLACED_SUFFIX = ".replaced"
METADATA_FILE = ".metadata"


def staging_path(path: str) -> str:
    return os.fspath(path).rstrip("/\\") + STAGING_SUFFIX


def begin(path: str) -> str:
    """Create an empty staging folder for ``path`` (rank 0; not collective: the caller agrees on its error with the
    other ranks before anything is written) and return its name."""
    staging = staging_path(path)
    if rank() == 0:
        if os.path.exists(staging):
            shutil.rmtree(staging)    # debris of an earlier interrupted save
        os.makedirs(staging)
    return staging


def commit(staging: str, path: str) -> None:
    """Rename the finished staging folder to ``path``, replacing what was there (collective over the world)."""
    barrier()
    error = None
    if rank() == 0:
        try:
            _swap_in(staging, path)
        except Exception as err:  # noqa: BLE001 - agreed on, so no rank waits for rank 0 forever
            error = err
    agree(error)


def _swap_in(staging: str, path: str) -> None:
    if not os.path.isfile(os.path.join(staging, METADATA_FILE)):
        raise IncompleteCheckpointError(f"{staging} has no {METADATA_FILE} after the save; not committing it.")
    replaced = os.fspath(path).rstrip("/\\") + _REPLACED_SUFFIX
    if os.path.lexists(replaced):
        _remove(replaced)
    if os.path.lexists(path):
        os.rename(path, replaced)         # the old checkpoint stays whole until the new one is in place
    os.rename(staging, path)
    if os.path.lexists(replaced):
        _remove(replaced)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


SHARD_SUFFIX = ".distcp"


def not_a_checkpoint_folder(path: str, what_it_is: str) -> str:
    """The message for a path that is no sharded checkpoint folder: what one looks like and how to get one."""
    return (f"{path} is not a lightning-megatron sharded checkpoint folder ({what_it_is}). A checkpoint is a folder "
            f"holding a {METADATA_FILE} file and shard files named __<rank>_<n>{SHARD_SUFFIX}; a ModelCheckpoint "
            f"callback or trainer.save_checkpoint(path) writes one while training with MegatronStrategy (save_sharded "
            f"without Lightning), and trainer.fit(ckpt_path=...) resumes from it. A single file written by "
            f"lightning_megatron.checkpoint.consolidate holds model weights only: trainer.validate/test/predict "
            f"(ckpt_path=...) read it; to train from it, load it with "
            f"lightning_megatron.checkpoint.load_consolidated(file, model) once the model is built and call "
            f"trainer.fit without ckpt_path.")


def check_folder(path: str) -> Metadata:
    """The DCP metadata of a finished checkpoint folder, or an error that says what is wrong."""
    path = os.fspath(path)
    if path.rstrip("/\\").endswith(STAGING_SUFFIX):
        raise IncompleteCheckpointError(
            f"{path} is the temporary folder of a save that did not finish (a rank failed or was killed before "
            f"every shard was written); load the previous checkpoint instead.")
    if not os.path.exists(path):
        hint = ""
        replaced = path.rstrip("/\\") + _REPLACED_SUFFIX
        if os.path.isdir(replaced):
            hint = (f" A save was interrupted while replacing it: the previous checkpoint is {replaced}, the new one "
                    f"{staging_path(path)}; rename the one you want to {path}.")
        elif os.path.isdir(staging_path(path)):
            hint = f" A save to it was interrupted ({staging_path(path)} is left over); load an earlier checkpoint."
        raise FileNotFoundError(f"no checkpoint at {path}.{hint}")
    if not os.path.isdir(path):
        raise IncompleteCheckpointError(not_a_checkpoint_folder(path, "it is a file"))
    metadata_file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(metadata_file):
        if not any(name.endswith(SHARD_SUFFIX) for name in os.listdir(path)):
            raise IncompleteCheckpointError(not_a_checkpoint_folder(
                path, f"it has neither a {METADATA_FILE} file nor {SHARD_SUFFIX} shard files"))
        raise IncompleteCheckpointError(
            f"{metadata_file} is missing: {path} holds shard files but is not a finished sharded checkpoint (an "
            f"interrupted save or a partial copy); use another checkpoint or copy this one again.")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file
        raise IncompleteCheckpointError(f"{metadata_file} cannot be read ({type(err).__name__}: {err}); the save or "
                                        f"copy was cut short: use another checkpoint.") from err
    _check_shard_files(path, metadata)
    return metadata


def _check_shard_files(path: str, metadata: Metadata) -> None:
    """Name the first shard file that ``.metadata`` refers to but the folder lacks."""
    storage = metadata.storage_data or {}
    first_key: Dict[str, str] = {}
    for index, info in storage.items():
        first_key.setdefault(info.relative_path, index.fqn)
    for relative, key in sorted(first_key.items()):
        if not os.path.isfile(os.path.join(path, relative)):
            raise IncompleteCheckpointError(
                f"shard file {os.path.join(path, relative)} is missing (it holds {key!r}, among others); the "
                f"checkpoint folder was copied or cleaned partially: restore the file or use another checkpoint.")


def find_metadata(path: str) -> Optional[Metadata]:
    """The metadata of ``path`` if it is a finished checkpoint folder, else None."""
    try:
        return check_folder(path)
    except (FileNotFoundError, IncompleteCheckpointError):
        return None
