"""A sharded BERT checkpoint as a Hugging Face directory, through ``models.hf_bert``'s exporter."""

from __future__ import annotations

import os
from typing import Union

from torch import nn

from ..models.hf_bert import save_hf_bert
from .sharded import load_sharded


def export_hf_bert(path: Union[str, os.PathLike], module: nn.Module, out_dir: Union[str, os.PathLike],
                   prefix: str = "") -> None:
    """Load the checkpoint at ``path`` into ``module`` and write it as an HF directory (collective).

    ``module`` is a ``BertModel`` or a task model holding one as ``.bert``, built at any layout
    (e.g. world size 1); ``prefix`` is where it sat in the saved module (``"model."`` for a
    LightningModule's ``self.model``). The HF names, Q/K/V split and vocabulary trim are
    ``save_hf_bert``'s; this only gets the weights in.
    """
    load_sharded(path, [module], strict=True, prefix=prefix)
    save_hf_bert(module, os.fspath(out_dir))
