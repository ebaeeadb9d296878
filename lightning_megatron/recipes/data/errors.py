"""One error type for bad input files, so every reader reports the same way: file, line, fix."""

from __future__ import annotations

from typing import Optional


class DataFormatError(ValueError):
    """A data file does not follow its official format; the message names the file and line."""

    def __init__(self, path: str, line: Optional[int], problem: str) -> None:
        self.path, self.line, self.problem = str(path), line, problem
        where = self.path if line is None else f"{self.path}, line {line}"
        super().__init__(f"{where}: {problem}")
