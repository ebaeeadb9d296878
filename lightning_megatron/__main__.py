"""``python -m lightning_megatron fit --config cfg.yaml`` (also the ``lightning-megatron`` command).

LightningCLI with any LightningModule / LightningDataModule named by ``class_path``; see
:mod:`lightning_megatron.recipes.cli` for what it adds (``--trainer.strategy megatron`` with options, one-line
user errors, ``LIGHTNING_MEGATRON_TRACEBACK=1`` for the full traceback).
"""

from __future__ import annotations

from lightning_megatron.recipes.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
