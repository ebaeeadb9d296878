"""The type check: ``python -m mypy`` from the repository root, configured by pyproject's ``[tool.mypy]``
(the package ``lightning_megatron``), reports no error. A developer runs the same command; the first run
takes ~40-50 s on two cores (it reads torch's and Lightning's inline types), later ones ~2 s from
``.mypy_cache``. mypy is in the ``test`` extra: without it this test fails, it is never skipped."""

import importlib.util
import subprocess
import sys

from helpers.paths import ROOT


def test_mypy_reports_no_errors():
    assert importlib.util.find_spec("mypy") is not None, (
        'mypy is not installed; it is part of the test extra: pip install -e ".[test]"')
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], cwd=ROOT,
                            capture_output=True, text=True, timeout=540)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"mypy found type errors (exit {result.returncode}):\n{output}"
    assert "Success: no issues found" in output, output
