"""One on/off switch per family of the project's Triton kernels.

On by default (where Triton imports and the tensors are on CUDA), off when the family's environment
variable is ``"0"``, and forced either way inside a block by tests and benchmarks, which compare the
kernels with the pure-torch path they replace.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional


class KernelSwitch:
    def __init__(self, env: str) -> None:
        self.env = env
        self.forced: Optional[bool] = None   # None: the environment decides

    def on(self) -> bool:
        return self.forced if self.forced is not None else os.environ.get(self.env, "1") != "0"

    @contextlib.contextmanager
    def forced_to(self, flag: bool) -> Iterator[None]:
        """Kernels on (where CUDA and Triton are) or off inside the block."""
        previous, self.forced = self.forced, flag
        try:
            yield
        finally:
            self.forced = previous
