"""The command line: ``python -m lightning_megatron fit --config cfg.yaml`` (also ``lightning-megatron``).

LightningCLI with any LightningModule / LightningDataModule named by ``class_path``, plus three things
a user of the command line needs:

- ``--trainer.strategy megatron`` takes options like the ``class_path`` form does
  (``--trainer.strategy.tensor_model_parallel_size 2``): the name is spelled out to
  ``lightning_megatron.MegatronStrategy`` before parsing.
- Usage and help name the command as it is typed (``python -m lightning_megatron``), and parsing the
  command line gives no LightningCLI warning about ``args``.
- A user error (a ``ValueError`` such as an invalid parallel layout or a bad data file, a missing file,
  a checkpoint error, a Lightning ``MisconfigurationException``) prints one line on rank 0 (the other
  ranks stay quiet) and exits with status 1; ``LIGHTNING_MEGATRON_TRACEBACK=1`` shows the full
  traceback. Any other exception keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_megatron  # noqa: F401  (registers strategy="megatron")

PROG = "python -m lightning_megatron"
TRACEBACK_ENV = "LIGHTNING_MEGATRON_TRACEBACK"
STRATEGY_NAME = "megatron"
STRATEGY_CLASS_PATH = "lightning_megatron.MegatronStrategy"
_STRATEGY_FLAG = "--trainer.strategy"


def expand_strategy_name(args: Sequence[str]) -> List[str]:
    """``--trainer.strategy megatron`` (or ``=megatron``) -> the class path, which takes options.

    Only when strategy options (``--trainer.strategy.<option>``) are given too: a class path alone parses
    as a plain string (``Trainer(strategy=...)`` accepts a string), so the bare name stays the registered name.
    """
    out = list(args)
    if not any(arg.startswith(_STRATEGY_FLAG + ".") for arg in out):
        return out
    for i, arg in enumerate(out):
        if arg == _STRATEGY_FLAG and i + 1 < len(out) and out[i + 1] == STRATEGY_NAME:
            out[i + 1] = STRATEGY_CLASS_PATH
        elif arg == f"{_STRATEGY_FLAG}={STRATEGY_NAME}":
            out[i] = f"{_STRATEGY_FLAG}={STRATEGY_CLASS_PATH}"
    return out


def _user_error_types() -> tuple:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_megatron.checkpoint.errors import CheckpointError

    # DataFormatError, ParallelConfigError, CheckpointMismatchError and CudaGraphShapeError are ValueErrors;
    # IncompleteCheckpointError is a FileNotFoundError.
    return (ValueError, FileNotFoundError, NotADirectoryError, CheckpointError, MisconfigurationException)


def is_user_error(err: BaseException) -> bool:
    return isinstance(err, _user_error_types())


def _rank() -> int:
    """This process's global rank: the strategy's once it has set up, else the launcher's environment."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    if rank is not None:
        return int(rank)
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _traceback_wanted() -> bool:
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def report_user_error(err: BaseException) -> None:
    """One clear message on stderr on rank 0; nothing on the other ranks."""
    if _rank() != 0:
        return
    message = str(err).strip() or "(no message)"
    print(f"error: {type(err).__name__}: {message}\n"
          f"(set {TRACEBACK_ENV}=1 for the full traceback)", file=sys.stderr, flush=True)


def run_cli(args: Optional[Sequence[str]] = None) -> LightningCLI:
    """Build and run the LightningCLI. ``args=None`` reads the command line (``sys.argv``)."""
    if args is None:
        # Rewrite sys.argv itself rather than pass ``args``: LightningCLI warns when given both, and
        # Lightning's launcher starts the other ranks with sys.argv, so they see the same command.
        sys.argv[1:] = expand_strategy_name(sys.argv[1:])
    else:
        args = expand_strategy_name(args)
    return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, save_config_kwargs={"overwrite": True},
                        parser_kwargs={"prog": PROG}, args=args)


def main(args: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m lightning_megatron`` and the ``lightning-megatron`` command."""
    try:
        run_cli(args)
    except Exception as err:
        if _traceback_wanted() or not is_user_error(err):
            raise
        report_user_error(err)
        sys.exit(1)
