"""Parallel preprocessing: raw files cut into line-aligned work units parsed by worker processes.

Data flow (each stage a process pool of ``workers``; the parent only plans and sums)::

    inputs --plan_units--> [Unit(path, start, end)]     plain files cut at line starts every ~split_bytes;
                                                         a .gz file is one unit (a gzip stream cannot be entered
                                                         mid-way), so day files run in parallel with each other
    units  --count_unit--> lines per unit                -> first file line and global row of every unit
    units  --fill_unit---> rows written in place into the preallocated {split}_*.npy memmaps (disjoint rows)
    train_sparse.npy --count_features--> train_id_freq.npy, one worker per group of features (disjoint slices)

Every worker streams ``chunk_rows`` lines at a time and counts into disk-backed slices, so memory is bounded
by workers x (chunk + one read block), whatever the data size. Rows land where the serial reader puts them,
the dense transform and the modulo are the same functions, and counts are exact integers: the output is
byte-identical to the serial run (tests/recipes/test_preprocess_parallel.py).
"""
from __future__ import annotations

import multiprocessing
import os
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from .avazu import AVAZU_HEADER, _decode_avazu
from .configs import AVAZU_COLUMNS
from .criteo import CRITEO_NUM_FIELDS, _decode_criteo, _split_fixed, open_binary, read_lines
from .transform import count_into, dense_transform  # the serial pass's own functions: the same bytes

#: Target bytes per unit of a plain file: big enough to amortize a task, small enough to balance workers.
DEFAULT_SPLIT_BYTES = 64 << 20
_FREQ_BLOCK_ROWS = 1 << 18
_rows_written = None  # in a worker of pool(workers, row_counter): that shared counter (progress), else None

_FORMATS = {  # raw_format -> (separator, fields per line, layout words for errors, decoder)
    "criteo_tsv": (b"\t", CRITEO_NUM_FIELDS, "tab-separated (label, I1..I13, C1..C26)", _decode_criteo),
    "avazu_csv": (b",", len(AVAZU_COLUMNS), "comma-separated", _decode_avazu),
}


class Unit(NamedTuple):
    """Lines of `path` starting in bytes [start, end); end None = to the end (a whole, possibly gzipped, file)."""

    path: str
    start: int
    end: int | None
    skip_header: bool  # the unit holds the file's header line (Avazu: checked, then skipped)


def default_workers() -> int:
    """All cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _line_start_at_or_after(f, pos: int) -> int:
    """First byte offset >= pos that starts a line (0, or just after a newline)."""
    if pos <= 0:
        return 0
    f.seek(pos - 1)
    f.readline()  # up to and including the next newline at or after pos - 1
    return f.tell()


def plan_units(inputs: Sequence[Path], header_lines: int, split_bytes: int) -> list[list[Unit]]:
    """Per input file, its units in file order."""
    if split_bytes < 1:
        raise ValueError(f"split_bytes={split_bytes!r}; expected >= 1")
    plans = []
    for path in inputs:
        spath = os.fspath(path)
        if spath.endswith(".gz"):
            plans.append([Unit(spath, 0, None, header_lines > 0)])
            continue
        size = os.path.getsize(spath)
        cuts = [0]
        with open(spath, "rb") as f:
            for pos in range(split_bytes, size, split_bytes):
                start = _line_start_at_or_after(f, pos)
                if cuts[-1] < start < size:
                    cuts.append(start)
        cuts.append(size)
        plans.append([Unit(spath, a, b, header_lines > 0 and a == 0) for a, b in zip(cuts[:-1], cuts[1:])])
    return plans


def _unit_lines(unit: Unit, first_line: int, chunk_rows: int):
    """Yield (first file line, [lines]) chunks of the unit, the header (if any) excluded; `first_line` is the
    file line of the unit's first data line."""
    line_no = first_line
    with open_binary(unit.path) as f:
        if unit.start:
            f.seek(unit.start)
        remaining = None if unit.end is None else unit.end - unit.start
        if unit.skip_header:
            header = b"".join(read_lines(f, 1, unit.path, 1))
            if remaining is not None:
                remaining -= len(header)
            header = header.rstrip(b"\r\n")
            if header.startswith(b"\xef\xbb\xbf"):
                header = header[3:]
            if header != AVAZU_HEADER.encode():
                raise ValueError(f"{unit.path}: line 1: expected the Avazu header {AVAZU_HEADER!r}, "
                                 f"got {header[:300].decode('utf-8', 'backslashreplace')!r}")
        while remaining is None or remaining > 0:
            lines = read_lines(f, chunk_rows, unit.path, line_no)
            if remaining is not None:
                # A chunk may run past the unit: keep the lines that start inside it.
                kept = 0
                for k, ln in enumerate(lines):
                    if remaining <= 0:
                        break
                    remaining -= len(ln)
                    kept = k + 1
                lines = lines[:kept]
            if not lines:
                return
            yield line_no, lines
            line_no += len(lines)


def count_unit(unit: Unit) -> int:
    """Data lines of the unit (a final line without a newline counts)."""
    n, last = 0, b"\n"
    with open_binary(unit.path) as f:
        if unit.start:
            f.seek(unit.start)
        remaining = None if unit.end is None else unit.end - unit.start
        while remaining is None or remaining > 0:
            try:
                block = f.read(1 << 24 if remaining is None else min(1 << 24, remaining))
            except (EOFError, OSError, zlib.error) as exc:
                raise ValueError(f"{unit.path}: line {n + 1}: the compressed stream is truncated or corrupt "
                                 f"({exc}); expected a complete gzip file (re-download or re-compress it)") from exc
            if not block:
                break
            n += block.count(b"\n")
            last = block[-1:]
            if remaining is not None:
                remaining -= len(block)
    return max(n + (last != b"\n") - unit.skip_header, 0)


class FillTask(NamedTuple):
    unit: Unit
    raw_format: str
    first_line: int  # 1-based file line of the unit's first data line
    row: int  # global row of the unit's first data line
    out: str  # the temporary output directory
    split_bounds: tuple[int, ...]  # global row where each split starts, plus the total
    splits: tuple[str, ...]
    table_sizes: tuple[int, ...]
    chunk_rows: int


def fill_unit(task: FillTask) -> int:
    """Parse the unit and write its rows in place; returns the rows written."""
    sep, num_fields, layout, decode = _FORMATS[task.raw_format]
    sizes = np.asarray(task.table_sizes, dtype=np.int64)
    out = Path(task.out)
    arrays = {}
    for k, split in enumerate(task.splits):
        if task.split_bounds[k + 1] > task.split_bounds[k]:
            arrays[split] = tuple(np.load(out / f"{split}_{kind}.npy", mmap_mode="r+")
                                  for kind in ("dense", "sparse", "labels"))
    pos = task.row
    for line_no, lines in _unit_lines(task.unit, task.first_line, task.chunk_rows):
        chunk = decode(task.unit.path, _split_fixed(task.unit.path, lines, sep, num_fields, line_no, layout), line_no)
        n = chunk.labels.shape[0]
        sparse, dense = chunk.cats % sizes, dense_transform(chunk.dense)
        for k, split in enumerate(task.splits):
            lo, hi = max(pos, task.split_bounds[k]), min(pos + n, task.split_bounds[k + 1])
            if lo >= hi:
                continue
            a, b, base = lo - pos, hi - pos, task.split_bounds[k]
            d_arr, s_arr, l_arr = arrays[split]
            d_arr[lo - base: hi - base] = dense[a:b]
            s_arr[lo - base: hi - base] = sparse[a:b]
            l_arr[lo - base: hi - base] = chunk.labels[a:b]
        pos += n
        if _rows_written is not None:
            with _rows_written.get_lock():
                _rows_written.value += n
    for arrs in arrays.values():
        for arr in arrs:
            arr.flush()
    return pos - task.row


def count_features(args: tuple[str, str, tuple[int, ...], tuple[int, ...]]) -> None:
    """Count the train ids of some features into their (disjoint) slices of the frequency file."""
    sparse_path, freq_path, features, offsets = args
    sparse = np.load(sparse_path, mmap_mode="r")
    freq = np.load(freq_path, mmap_mode="r+")
    for lo in range(0, sparse.shape[0], _FREQ_BLOCK_ROWS):
        block = np.asarray(sparse[lo: lo + _FREQ_BLOCK_ROWS])
        for f in features:
            count_into(freq[offsets[f]: offsets[f + 1]], block[:, f], offsets[f + 1] - offsets[f])
    freq.flush()


def _context():
    # fork: workers run numpy-only code and start in milliseconds (spawn would re-import torch per worker).
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def row_counter():
    """A count shared with the workers of `pool(workers, row_counter)`: the rows fill_unit has written so far,
    so the parent can report progress inside units (a unit is ~split_bytes, the whole file of a small data set)."""
    return _context().Value("q", 0)


def _share_row_counter(counter) -> None:
    global _rows_written
    _rows_written = counter


def pool(workers: int, row_counter=None) -> ProcessPoolExecutor:
    """`workers` processes; with `row_counter` (from row_counter()) fill_unit adds the rows it writes to it."""
    if row_counter is None:
        return ProcessPoolExecutor(max_workers=workers, mp_context=_context())
    return ProcessPoolExecutor(max_workers=workers, mp_context=_context(), initializer=_share_row_counter,
                               initargs=(row_counter,))


def balance_features(table_sizes: Sequence[int], workers: int) -> list[tuple[int, ...]]:
    """Features dealt to `workers` groups, largest tables first, each to the lightest group (by rows)."""
    groups: list[list[int]] = [[] for _ in range(min(workers, len(table_sizes)))]
    load = [0] * len(groups)
    for f in sorted(range(len(table_sizes)), key=lambda f: -table_sizes[f]):
        g = load.index(min(load))
        groups[g].append(f)
        load[g] += table_sizes[f] + 1
    return [tuple(sorted(g)) for g in groups if g]
