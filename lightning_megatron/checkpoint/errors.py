"""What can go wrong with a checkpoint, as exception types callers can catch."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base of the checkpoint errors; the message names the key or file and the fix."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """A folder that is not a finished save: interrupted, half-copied, or a missing shard file."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer it is loaded into (keys or shapes)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Bytes of a shard file differ from the checksum written at save: the file was damaged on disk or in a copy."""


def summarize_failures(err: BaseException) -> str:
    """``rank 1: OSError: disk full`` for each failed rank of a DCP ``CheckpointException``."""
    failures = getattr(err, "failures", None)
    if not failures:
        return f"{type(err).__name__}: {err}"
    parts = []
    for rank, (exc, _trace) in sorted(failures.items()):
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return "; ".join(parts)
