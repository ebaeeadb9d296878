"""``python -m lightning_megatron fit --config cfg.yaml`` (also the ``lightning-megatron`` command).

LightningCLI with any LightningModule / LightningDataModule named by ``class_path``;
``trainer.strategy: megatron`` works because importing this package registers the name.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_megatron  # noqa: F401  (registers strategy="megatron")


def main(args: Optional[List[str]] = None) -> None:
    LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main(sys.argv[1:])
