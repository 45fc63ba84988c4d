"""Streaming reader for the raw Avazu CTR CSV (``train.csv``, header required).

Every categorical value is treated as a string and hashed deterministically to a
non-negative int64 (never Python's per-process randomised ``hash()``), so ids are
stable across runs and machines. ``hour`` (``YYMMDDHH``) becomes two extra
categoricals, hour-of-day and weekday, plus one dense feature, hour-of-day / 23.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterator

import numpy as np

from .configs import AVAZU_COLUMNS, AVAZU_HASHED_COLUMNS
from .criteo import (
    DEFAULT_CHUNK_ROWS,
    RawChunk,
    _check_labels,
    _fail,
    _first_error,
    _split_fixed,
    open_binary,
    parse_int_fields,
    read_lines,
)

__all__ = [
    "AVAZU_HEADER",
    "AVAZU_NUM_DENSE",
    "AVAZU_NUM_CAT",
    "splitmix64",
    "hash_categorical",
    "read_avazu_csv",
]

AVAZU_HEADER = ",".join(AVAZU_COLUMNS)
AVAZU_NUM_DENSE = 1
AVAZU_NUM_CAT = len(AVAZU_HASHED_COLUMNS) + 2  # + hour_of_day, weekday

_MASK63 = np.uint64((1 << 63) - 1)
_HOUR_COL = AVAZU_COLUMNS.index("hour")
_CLICK_COL = AVAZU_COLUMNS.index("click")
_FIRST_CAT_COL = AVAZU_COLUMNS.index(AVAZU_HASHED_COLUMNS[0])


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a fast bijective mix of uint64 values (wraps mod 2**64)."""
    with np.errstate(over="ignore"):  # wrap-around is the point
        z = np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _blake_hash63(value: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(value, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def hash_categorical(fields: np.ndarray) -> np.ndarray:
    """Hash a bytes (``S``) array of categorical strings to non-negative int64.

    Strings of 1-15 hex digits (all of Avazu's values, hex ids and decimal codes alike)
    are hashed by value: ``splitmix64(int(s, 16))``, vectorised; so ``"0a"``, ``"a"`` and
    ``"A"`` are the same id. Anything else, including the empty string, goes through an
    8-byte BLAKE2b of the raw bytes. Both land in [0, 2**63); the mixing makes
    ``% table_size`` behave for any table size.
    """
    values, ok, empty = parse_int_fields(fields, 16)
    out = (splitmix64(values) & _MASK63).astype(np.int64)
    other = ~ok | empty
    if other.any():
        uniq, inverse = np.unique(fields[other], return_inverse=True)
        hashed = np.fromiter((_blake_hash63(u) for u in uniq.tolist()), dtype=np.int64, count=uniq.size)
        out[other] = hashed[inverse.reshape(-1)]
    return out


def _decode_hour(path: str, col: np.ndarray, first_line: int, errors: list) -> tuple[np.ndarray, np.ndarray]:
    """``YYMMDDHH`` (20YY) -> (hour of day 0..23, weekday 0=Monday..6)."""
    value, ok, empty = parse_int_fields(col, 10)
    ok &= ~empty & (np.char.str_len(col) == 8) & ~np.char.startswith(col, b"-") & ~np.char.startswith(col, b"+")
    yy, mm, dd, hh = value // 1_000_000, value // 10_000 % 100, value // 100 % 100, value % 100
    ok &= (mm >= 1) & (mm <= 12) & (dd >= 1) & (dd <= 31) & (hh <= 23)
    month = np.where(ok, (2000 + yy - 1970) * 12 + mm - 1, 0).astype("datetime64[M]")
    day = month.astype("datetime64[D]") + np.where(ok, dd - 1, 0)
    ok &= day.astype("datetime64[M]") == month  # rejects e.g. Feb 30
    bad = np.flatnonzero(~ok)
    if bad.size:
        i = int(bad[0])
        errors.append((i, _HOUR_COL, _fail(path, first_line + i, f"hour (column {_HOUR_COL + 1})",
                                           "a valid YYMMDDHH timestamp such as '14102100'", col[i])))
    weekday = (day.astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday
    return np.where(ok, hh, 0), np.where(ok, weekday, 0)


def _decode_avazu(path: str, fields: np.ndarray, first_line: int) -> RawChunk:
    errors: list[tuple[int, int, ValueError]] = []
    labels = _check_labels(path, fields[:, _CLICK_COL], first_line, f"click (column {_CLICK_COL + 1})", errors)
    hour_of_day, weekday = _decode_hour(path, fields[:, _HOUR_COL], first_line, errors)
    _first_error(errors)
    n = fields.shape[0]
    cats = np.empty((n, AVAZU_NUM_CAT), dtype=np.int64)
    cats[:, : len(AVAZU_HASHED_COLUMNS)] = hash_categorical(fields[:, _FIRST_CAT_COL:])
    cats[:, -2] = hour_of_day
    cats[:, -1] = weekday
    dense = (hour_of_day.astype(np.float32) / np.float32(23.0)).reshape(n, 1)
    return RawChunk(labels, dense, cats, first_line)


def read_avazu_csv(path: str | os.PathLike, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[RawChunk]:
    """Yield :class:`RawChunk` s from an Avazu CSV: dense ``[n, 1]`` (hour/23), cats
    ``[n, 23]`` (21 hashed columns in header order, then hour-of-day and weekday).

    The header must equal :data:`AVAZU_HEADER`. Malformed lines raise ``ValueError``
    naming the file, 1-based line (the header is line 1) and field.
    """
    if chunk_rows < 1:
        raise ValueError(f"read_avazu_csv: chunk_rows={chunk_rows!r}; expected >= 1")
    spath = os.fspath(path)
    with open_binary(spath) as f:
        header = b"".join(read_lines(f, 1, spath, 1)).rstrip(b"\r\n")
        if header.startswith(b"\xef\xbb\xbf"):
            header = header[3:]
        if header != AVAZU_HEADER.encode():
            raise ValueError(
                f"{spath}: line 1: expected the Avazu header {AVAZU_HEADER!r}, "
                f"got {header[:300].decode('utf-8', 'backslashreplace')!r}"
            )
        line_no = 2
        while True:
            lines = read_lines(f, chunk_rows, spath, line_no)
            if not lines:
                return
            fields = _split_fixed(spath, lines, b",", len(AVAZU_COLUMNS), line_no, "comma-separated")
            yield _decode_avazu(spath, fields, line_no)
            line_no += len(lines)
