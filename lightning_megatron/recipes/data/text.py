"""UTF-8 decoding for the readers: bytes that are not UTF-8 raise ``DataFormatError`` naming the file
and line, where Python's bare ``UnicodeDecodeError`` names neither."""

from __future__ import annotations

from typing import BinaryIO, Iterator, Tuple

from .errors import DataFormatError


def _not_utf8(path: str, data: bytes, error: UnicodeDecodeError, first_line: int = 1) -> DataFormatError:
    """The error for ``data`` (text starting at ``first_line``) that failed to decode at ``error.start``."""
    line = first_line + data.count(b"\n", 0, error.start)
    column = error.start - data.rfind(b"\n", 0, error.start)    # 1-based byte offset within the line
    return DataFormatError(path, line, f"byte 0x{data[error.start]:02x} at byte {column} of the line is not UTF-8 "
                                       "text; the official release is UTF-8: download it again, or convert this "
                                       "file (e.g. iconv -f latin1 -t utf-8).")


def utf8_lines(f: BinaryIO, path: str, first_line: int = 1) -> Iterator[Tuple[int, str]]:
    """``(line number, text)`` of each line of a file opened in binary mode, one line at a time (GLUE's
    train.tsv is ~400 MB), so a bad byte is reported with its line. Lines keep their line ending."""
    for line_no, raw in enumerate(f, start=first_line):
        try:
            yield line_no, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(path, raw, e, line_no) from None


def read_utf8(path: str) -> str:
    """The whole file as text (for small files); a bad byte is reported with its line."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, data, e) from None
