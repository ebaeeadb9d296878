"""Every Triton kernel family of the package (the gated activations, the fused loss's passes, alone and around the
float8 output layer's GEMMs, MoE permute and unpermute) against its torch path on the CPU, through Triton's interpreter (``TRITON_INTERPRET=1``), so that CI,
which has no GPU, still checks what the kernels compute. The cases are in ``tests/helpers/interpret_kernels.py``;
the compiled kernels on a GPU: tests/gpu/."""

import os
import subprocess
import sys

import triton  # noqa: F401  (a declared test dependency: its absence fails here, not silently)

from helpers.paths import ROOT


def test_kernels_compute_what_their_torch_paths_compute():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "interpret_kernels.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "WRONG "))]
    assert done.returncode == 0, "\n".join(lines) + "\n" + done.stderr[-3000:]
    assert len(lines) == 21 and all(line.startswith("ok ") for line in lines), "\n".join(lines)
