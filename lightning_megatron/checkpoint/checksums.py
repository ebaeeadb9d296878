"""A crc32 of every item stored in a shard file (tensor piece or pickled object), written at save, checked at load.

A byte flipped on disk inside a tensor's payload still unpickles into a tensor, only a slightly wrong one; without a
check it loads silently. Each rank's writer, once its shard files are written, reads every item's byte range back
(mapped from the page cache) and writes ``<shard file>.crc32`` beside it, before ``.metadata`` exists and so before the
folder is made visible. The reader checks each item's bytes in place before DCP reads them. Folders without any ``.crc32`` file (saved before checksums existed, or with ``checksums=False``)
load unchecked; a folder with some of them must have one for every shard file.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from typing import IO, Any, Dict, List, Optional, Tuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CorruptCheckpointError, IncompleteCheckpointError

SUFFIX = ".crc32"
_CHUNK = 1 << 24   # bytes read and hashed at a time

_Sums = Dict[int, Tuple[int, int]]   # offset -> (length, crc32)


def crc32_of(file: IO[bytes], offset: int, length: int) -> int:
    """The crc32 of ``length`` bytes of the open ``file`` at ``offset``, hashed in place (mapped, no copy)."""
    if length == 0:
        return zlib.crc32(b"")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(file.fileno(), offset + length - start, access=mmap.ACCESS_READ, offset=start)
    except ValueError:   # the file is shorter than the range (truncated): the sum of what is left
        file.seek(offset)
        return zlib.crc32(file.read(length))
    with mapped, memoryview(mapped) as view:
        crc = 0
        for at in range(offset - start, offset - start + length, _CHUNK):
            crc = zlib.crc32(view[at:min(at + _CHUNK, offset - start + length)], crc)
        return crc


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer that also writes a crc32 per stored item into ``<shard file>.crc32``."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        by_file: Dict[str, List[Tuple[int, int]]] = {}
        for result in future.wait():
            info = result.storage_data
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        for relative, items in by_file.items():
            shard = os.path.join(self.path, relative)
            with open(shard, "rb") as stream:
                sums = [[offset, length, crc32_of(stream, offset, length)] for offset, length in sorted(items)]
            with open(shard + SUFFIX, "w") as out:
                json.dump({"algorithm": "crc32", "items": sums}, out)
                if self.sync_files:
                    out.flush()
                    os.fsync(out.fileno())
        return future


class ChecksumReader(FileSystemReader):
    """DCP's file reader that checks every item it reads against its ``.crc32`` (when the folder has them)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._sums: Dict[str, Optional[_Sums]] = {}
        self._names: Dict[Tuple[str, int], str] = {}
        self._has_sums: Optional[bool] = None

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._names = {(info.relative_path, info.offset): index.fqn for index, info in self.storage_data.items()}

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        sums = self._sums_of(sinfo.relative_path)
        if sums is None:
            return super()._slice_file(file, sinfo)
        length, expected = sums.get(sinfo.offset, (None, None))
        actual = crc32_of(file, sinfo.offset, sinfo.length)
        if length != sinfo.length or actual != expected:
            shard = os.path.join(os.fspath(self.path), sinfo.relative_path)
            name = self._names.get((sinfo.relative_path, sinfo.offset), "?")
            found = "no checksum" if expected is None else f"crc32 {expected:08x}"
            raise CorruptCheckpointError(
                f"shard file {shard} is damaged: the {sinfo.length} bytes of {name!r} at offset {sinfo.offset} do not "
                f"match the checksum written at save ({found}, the bytes now give {actual:08x}); the file changed on "
                f"disk or in a copy: restore it from a good copy or load another checkpoint.")
        return super()._slice_file(file, sinfo)

    def _sums_of(self, relative: str) -> Optional[_Sums]:
        if relative in self._sums:
            return self._sums[relative]
        root = os.fspath(self.path)
        if self._has_sums is None:
            self._has_sums = any(name.endswith(SUFFIX) for name in os.listdir(root))
        sums = None
        if self._has_sums:
            sidecar = os.path.join(root, relative + SUFFIX)
            if not os.path.isfile(sidecar):
                raise IncompleteCheckpointError(
                    f"{sidecar} is missing: the other shard files of {root} have checksums, so this one was lost in a "
                    f"copy; copy the checkpoint folder again (or delete every {SUFFIX} file to load it unchecked).")
            try:
                with open(sidecar) as stream:
                    sums = {int(o): (int(n), int(c)) for o, n, c in json.load(stream)["items"]}
            except (ValueError, KeyError, TypeError) as err:
                raise CorruptCheckpointError(f"checksum file {sidecar} is damaged ({type(err).__name__}: {err}); "
                                             f"restore it from a good copy or load another checkpoint.") from err
        self._sums[relative] = sums
        return sums


def load_checked(path: str, planner: Any, **kwargs: Any) -> None:
    """``dcp.load`` through :class:`ChecksumReader`; a damaged item or a lost ``.crc32`` file raises its own error.

    DCP gathers every rank's read failures and raises the same ``CheckpointException`` on every rank; the lowest
    rank's checksum failure is re-raised from it, so every rank raises the same error and none is left waiting."""
    try:
        dcp.load({}, storage_reader=ChecksumReader(path), planner=planner, **kwargs)
    except CheckpointException as err:
        for _rank, (exc, _trace) in sorted(getattr(err, "failures", {}).items()):
            if isinstance(exc, (CorruptCheckpointError, IncompleteCheckpointError)):
                raise type(exc)(str(exc)) from err
        raise
