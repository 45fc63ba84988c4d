"""Streaming reader for raw Criteo TSV (Kaggle ``train.txt`` and the 1TB ``day_*`` files).

Each line is ``label \\t I1..I13 \\t C1..C26``: 40 tab-separated fields, any dense (I) or
categorical (C) field may be empty. Files are read a chunk of lines at a time, so the
reader works on files far larger than memory; per chunk, numbers are decoded with
vectorised byte lookups rather than per-value Python calls.
"""

from __future__ import annotations

import gzip
import os
import zlib
from itertools import islice
from typing import BinaryIO, Iterator, NamedTuple

import numpy as np

__all__ = [
    "RawChunk",
    "CRITEO_NUM_DENSE",
    "CRITEO_NUM_CAT",
    "CRITEO_NUM_FIELDS",
    "MISSING_CAT",
    "DEFAULT_CHUNK_ROWS",
    "open_binary",
    "read_lines",
    "parse_int_fields",
    "read_criteo_tsv",
]

CRITEO_NUM_DENSE = 13
CRITEO_NUM_CAT = 26
CRITEO_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_CAT

#: Value an empty Criteo categorical field decodes to. Same as torchrec (``int("0", 16)``):
#: after ``% table_size`` missing values share row 0 of every table.
MISSING_CAT = 0

DEFAULT_CHUNK_ROWS = 1 << 16

_HEX_MAX_DIGITS = 15  # 15 hex digits < 2**60: always a non-negative int64
_DEC_MAX_DIGITS = 18  # 18 decimal digits < 2**63

# Byte -> code: 0..15 digit value, _PAD for NUL padding of numpy's fixed-width bytes,
# _SIGN for '+'/'-', -1 for anything else.
_PAD = 16
_SIGN = 17


def _lut(base: int) -> np.ndarray:
    lut = np.full(256, -1, dtype=np.int8)
    lut[0] = _PAD
    for i, ch in enumerate(b"0123456789"):
        lut[ch] = i
    if base == 16:
        for i, ch in enumerate(b"abcdef"):
            lut[ch] = 10 + i
        for i, ch in enumerate(b"ABCDEF"):
            lut[ch] = 10 + i
    else:
        lut[ord("+")] = _SIGN
        lut[ord("-")] = _SIGN
    return lut


_LUTS = {10: _lut(10), 16: _lut(16)}


class RawChunk(NamedTuple):
    """One block of decoded lines; ``first_line`` is the 1-based file line of row 0."""

    labels: np.ndarray  # int8 [n], 0 or 1
    dense: np.ndarray  # float32 [n, num_dense], raw values, empty -> 0
    cats: np.ndarray  # int64 [n, num_cat], non-negative raw ids
    first_line: int


def open_binary(path: str | os.PathLike) -> BinaryIO:
    """Open a raw file for byte-wise reading; ``.gz`` files (how Criteo 1TB ships) are
    decompressed on the fly."""
    path = os.fspath(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def read_lines(f: BinaryIO, n: int, path: str, first_line: int) -> list[bytes]:
    """Up to ``n`` lines of ``f``; a truncated or corrupt ``.gz`` stream becomes a ``ValueError`` naming the file
    and the first line that could not be read (gzip's own EOFError names neither)."""
    lines: list[bytes] = []
    try:
        for line in islice(f, n):
            lines.append(line)
    except (EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"{path}: line {first_line + len(lines)}: the compressed stream is truncated or corrupt "
                         f"({exc}); expected a complete gzip file (re-download or re-compress it)") from exc
    return lines


def parse_int_fields(fields: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode a fixed-width bytes array (numpy ``S`` dtype) of integer literals.

    Returns ``(values int64, ok bool, empty bool)`` of ``fields.shape``. Base 16 accepts
    1-15 hex digits, base 10 an optional sign then 1-18 digits; ``ok`` is False for
    anything else except the empty string (``empty`` True, value 0).
    """
    if fields.dtype.kind != "S":
        raise TypeError(f"parse_int_fields: expected a numpy bytes (S) array, got dtype {fields.dtype}")
    if base not in _LUTS:
        raise ValueError(f"parse_int_fields: base={base!r}; expected 10 or 16")
    shape = fields.shape
    width = fields.dtype.itemsize
    raw = np.ascontiguousarray(fields).view(np.uint8).reshape(shape + (width,))
    codes = _LUTS[base][raw]
    is_pad = codes == _PAD
    is_sign = codes == _SIGN
    is_digit = codes >= 0
    is_digit &= ~is_pad
    is_digit &= ~is_sign
    ndigits = is_digit.sum(axis=-1)
    nchars = width - is_pad.sum(axis=-1)
    ok = ~(codes < 0).any(axis=-1)
    if width > 1:
        # numpy strips only trailing NULs, so a NUL followed by a character is real data.
        ok &= ~(is_pad[..., :-1] & ~is_pad[..., 1:]).any(axis=-1)
        ok &= ~is_sign[..., 1:].any(axis=-1)
    max_digits = _HEX_MAX_DIGITS if base == 16 else _DEC_MAX_DIGITS
    empty = nchars == 0
    ok &= empty | ((ndigits >= 1) & (ndigits <= max_digits))
    digits = np.where(is_digit, codes, 0)  # int8: keep the [..., width] temporaries small
    values = np.zeros(shape, dtype=np.int64)
    for k in range(min(width, max_digits + 1)):
        values = np.where(is_digit[..., k], values * base + digits[..., k].astype(np.int64), values)
    if base == 10:
        values = np.where(raw[..., 0] == ord("-"), -values, values)
    values[~ok] = 0
    return values, ok, empty


def _fail(path: str, line: int, field: str, expected: str, got: bytes) -> ValueError:
    shown = got.decode("utf-8", "backslashreplace")
    return ValueError(f"{path}: line {line}: field {field}: expected {expected}, got {shown!r}")


def _split_fixed(path: str, lines: list[bytes], sep: bytes, num_fields: int, first_line: int, layout: str) -> np.ndarray:
    """Split lines into an ``[n, num_fields]`` bytes array, rejecting non-ASCII bytes and wrong field counts
    (the raw CTR files are ASCII; a byte >= 0x80 means corruption or the wrong file)."""
    stripped = [ln.rstrip(b"\r\n") for ln in lines]
    counts = np.fromiter((ln.count(sep) for ln in stripped), dtype=np.int64, count=len(stripped))
    joined = sep.join(stripped)
    if joined and np.frombuffer(joined, dtype=np.uint8).max() >= 0x80:
        i = next(k for k, ln in enumerate(stripped) if not ln.isascii())
        col = next(k for k, fld in enumerate(stripped[i].split(sep)) if not fld.isascii())
        byte = next(b for b in stripped[i] if b >= 0x80)
        raise ValueError(
            f"{path}: line {first_line + i}: column {col + 1}: non-ASCII byte 0x{byte:02x}; expected an ASCII "
            f"{layout} line: {stripped[i][:200].decode('utf-8', 'backslashreplace')!r}"
        )
    bad = np.flatnonzero(counts != num_fields - 1)
    if bad.size:
        i = int(bad[0])
        cut = "" if lines[i].endswith(b"\n") else " (the file ends mid-line: truncated?)"
        raise ValueError(
            f"{path}: line {first_line + i}: expected {num_fields} {layout} fields, "
            f"got {int(counts[i]) + 1}{cut}: {stripped[i][:200].decode('utf-8', 'backslashreplace')!r}"
        )
    return np.array(sep.join(stripped).split(sep), dtype=np.bytes_).reshape(len(stripped), num_fields)


def _first_error(candidates: list[tuple[int, int, ValueError]]) -> None:
    """Raise the error of the earliest line (then leftmost field) among per-column checks."""
    if candidates:
        raise min(candidates, key=lambda c: (c[0], c[1]))[2]


def _check_labels(path: str, col: np.ndarray, first_line: int, name: str, errors: list) -> np.ndarray:
    is_one = col == b"1"
    bad = np.flatnonzero(~(is_one | (col == b"0")))
    if bad.size:
        i = int(bad[0])
        errors.append((i, 0, _fail(path, first_line + i, name, "label 0 or 1", col[i])))
    return is_one.astype(np.int8)


def _decode_criteo(path: str, fields: np.ndarray, first_line: int) -> RawChunk:
    errors: list[tuple[int, int, ValueError]] = []
    labels = _check_labels(path, fields[:, 0], first_line, "label (column 1)", errors)
    dense, ok, _ = parse_int_fields(fields[:, 1 : 1 + CRITEO_NUM_DENSE], 10)
    rows, cols = np.nonzero(~ok)
    if rows.size:
        i, j = int(rows[0]), int(cols[0])
        errors.append((i, 1 + j, _fail(path, first_line + i, f"I{j + 1} (column {j + 2})",
                                       "an integer or empty", fields[i, 1 + j])))
    cats, ok, _ = parse_int_fields(fields[:, 1 + CRITEO_NUM_DENSE :], 16)
    rows, cols = np.nonzero(~ok)
    if rows.size:
        i, j = int(rows[0]), int(cols[0])
        errors.append((i, 14 + j, _fail(path, first_line + i, f"C{j + 1} (column {j + 15})",
                                        "1-15 hex digits (e.g. '68fd1e64') or empty",
                                        fields[i, 1 + CRITEO_NUM_DENSE + j])))
    _first_error(errors)
    # Empty categoricals decode to 0 == MISSING_CAT.
    return RawChunk(labels, dense.astype(np.float32), cats, first_line)


def read_criteo_tsv(path: str | os.PathLike, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[RawChunk]:
    """Yield :class:`RawChunk` s of up to ``chunk_rows`` lines from a Criteo TSV file.

    Dense values are the raw integers as float32 (empty -> 0; the log transform is
    preprocessing's job). Categoricals are the hex ids as int64, empty -> ``MISSING_CAT``.
    A malformed line raises ``ValueError`` naming the file, 1-based line and field.
    """
    if chunk_rows < 1:
        raise ValueError(f"read_criteo_tsv: chunk_rows={chunk_rows!r}; expected >= 1")
    spath = os.fspath(path)
    with open_binary(spath) as f:
        line_no = 1
        while True:
            lines = read_lines(f, chunk_rows, spath, line_no)
            if not lines:
                return
            fields = _split_fixed(spath, lines, b"\t", CRITEO_NUM_FIELDS, line_no,
                                  "tab-separated (label, I1..I13, C1..C26)")
            yield _decode_criteo(spath, fields, line_no)
            line_no += len(lines)
