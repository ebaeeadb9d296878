"""A sharded Llama / Mistral / Mixtral checkpoint as a Hugging Face directory, through ``models.hf_llama``."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
from torch import nn

from ..models.hf_llama import save_hf_llama
from .sharded import load_sharded


def export_hf_llama(path: Union[str, os.PathLike], module: nn.Module, out_dir: Union[str, os.PathLike],
                    prefix: str = "", max_shard_size: Union[int, str] = "5GB", dtype: Optional[torch.dtype] = None,
                    model_type: Optional[str] = None) -> None:
    """Load the checkpoint at ``path`` into ``module`` and write it as an HF directory (collective).

    ``module`` holds the ``LlamaModel`` (a chunk, ``VirtualChunks`` of them, or a module containing
    them), built at any layout (e.g. world size 1); ``prefix`` is where it sat in the saved module
    (``"model."`` for a LightningModule's ``self.model``). The rest is ``save_hf_llama``'s.
    """
    load_sharded(path, [module], strict=True, prefix=prefix)
    save_hf_llama(module, os.fspath(out_dir), max_shard_size=max_shard_size, dtype=dtype, model_type=model_type)
