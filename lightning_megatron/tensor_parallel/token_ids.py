"""Token ids (inputs and labels) must lie in the real vocabulary ``[0, vocab_size)``.

The embedding table and the logits are padded past ``vocab_size`` so they split evenly over
tensor-parallel ranks (``pad_vocab_size``). Those rows are zeros, stay out of checkpoints and
change with the tp size: an id that falls into them would train silently on a row the model
does not have. Every id is checked, but where the check runs matters for speed:

* On the CPU it always runs on the host: ``ids.min()``/``max()`` over a ``[b, s]`` tensor cost
  nothing next to the model, and the error can name the offending id and ``vocab_size``.
* On CUDA, reading anything back to the host would stall the GPU on every step. So by default
  the check stays on the device, ``torch._assert_async``: no host sync (on an H100 with torch
  2.11 the call returned in 0.3 ms with 200 ms of work queued), and the run stops instead of
  training on a padding row. But that is no clear error: the kernel prints only a fixed string
  on stderr (``Assertion `input id outside [0, vocab_size=64); set LIGHTNING_MEGATRON_CHECK_IDS=1
  to see which` failed``), it cannot name the id, Python raises the generic "CUDA error:
  device-side assert triggered" at some later call, and the CUDA context is lost. So the
  clear error on CUDA comes with the debug flag: ``LIGHTNING_MEGATRON_CHECK_IDS=1`` (or
  ``check_ids=True`` on ``VocabParallelEmbedding``) checks on the host, at the cost of one sync
  per forward; running the batch on the CPU gives it too. While a CUDA graph is being captured
  the host check is skipped (nothing can be read back then); the device-side assert is
  captured with the graph.

The id check runs before any communication and every tensor-parallel rank holds the same ids, so
all of them raise it together. Ranks that hold other data (data- or context-parallel peers)
do not: like any error in one rank's step, the others stop at the strategy's timeout.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

CHECK_IDS_ENV = "LIGHTNING_MEGATRON_CHECK_IDS"


def check_ids_on_host(ids: torch.Tensor, check: Optional[bool] = None) -> bool:
    """Whether ``ids`` are checked on the host (with a clear error) rather than on the device.

    ``check``: True/False forces it; None (the default) checks CPU tensors always and CUDA
    tensors only when the environment variable ``LIGHTNING_MEGATRON_CHECK_IDS`` is set to a true
    value (not ``""``, ``"0"``, ``"false"``). Tensors that hold no data (``meta``) are never read.
    """
    if ids.device.type == "meta":
        return False
    if check is not None:
        return check
    if ids.device.type == "cpu":
        return True
    return os.environ.get(CHECK_IDS_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def check_ids_in_vocab(ids: torch.Tensor, vocab_size: int, *, what: str = "input id",
                       padded_vocab_size: Optional[int] = None, ignore_index: Optional[int] = None,
                       check: Optional[bool] = None) -> None:
    """Raise ``ValueError`` naming the first id of ``ids`` outside ``[0, vocab_size)`` (ids equal to
    ``ignore_index`` are allowed). On the host or on the device, as ``check_ids_on_host`` decides
    (see the module docstring); the same ids give the same error on every rank."""
    if ids.device.type == "meta":
        return
    on_host = check_ids_on_host(ids, check)
    if not on_host or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        if ids.is_cuda:
            valid = (ids >= 0) & (ids < vocab_size)
            if ignore_index is not None:
                valid |= ids == ignore_index
            torch._assert_async(valid.all(), f"{what} outside [0, vocab_size={vocab_size}); "
                                             f"set {CHECK_IDS_ENV}=1 to see which")
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if not bool(bad.any()):
        return
    offenders = ids[bad]
    first, count = int(offenders[0]), offenders.numel()
    low, high = int(offenders.min()), int(offenders.max())
    spread = f"{count} of the {ids.numel()} ids in this batch are, from {low} to {high}" if count > 1 else \
        f"1 of the {ids.numel()} ids in this batch"
    message = f"{what} {first} is outside the vocabulary [0, vocab_size={vocab_size}) ({spread})."
    if padded_vocab_size is not None and bool(((offenders >= vocab_size) & (offenders < padded_vocab_size)).any()):
        message += (f" Ids in [{vocab_size}, {padded_vocab_size}) fall into the padding rows added so the table "
                    f"splits evenly over the tensor-parallel ranks: they are not part of the model (zeros, left "
                    f"out of checkpoints, different at another tp size).")
    if high >= vocab_size:
        message += (f" If the data was tokenized with a larger vocabulary than the model's, build the model with "
                    f"the tokenizer's vocabulary size (vocab_size={high + 1} at least); otherwise fix the ids.")
    if low < 0:
        hint = f" other than ignore_index={ignore_index}" if ignore_index is not None else ""
        message += f" Negative ids{hint} are never valid: check how the batch was padded or masked."
    raise ValueError(message)
