"""One benchmark configuration per process: a fresh CUDA context, allocator and compile cache for each, so no
configuration's memory or warm-up leaks into the next. The child prints ``RESULT {json}``; the parent reads it."""

from __future__ import annotations

import json
import subprocess
from typing import List, Optional

PREFIX = "RESULT "


def print_result(result: dict) -> None:
    """What a child prints for its parent (the last such line counts)."""
    print(PREFIX + json.dumps(result), flush=True)


def run_isolated(name: str, cmd: List[str], timeout: Optional[float] = None) -> Optional[dict]:
    """Run ``cmd`` (one configuration) and return its result, or ``None`` after printing why there is none (a
    timeout, a failure with the end of its stderr)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: TIMEOUT", flush=True)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode or not lines:
        print(f"{name}: FAILED (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(lines[-1][len(PREFIX):])
