"""Raw TSV/CSV -> a directory of memory-mapped ``.npy`` arrays, one set per split.

Output (``out_dir``)::

    {split}_dense.npy    float32 [n, num_dense]  dense_transform(raw)
    {split}_sparse.npy   int64   [n, num_cat]    raw_id % table_size (per feature)
    {split}_labels.npy   float32 [n]
    train_id_freq.npy          int64 [sum(table_sizes)]  per-id counts over TRAIN only,
    train_id_freq_offsets.npy  int64 [num_cat + 1]       feature f is [offsets[f], offsets[f+1])
    metadata.json

Parsing happens once, at preprocessing, so training reads fixed-width arrays straight
from the page cache. Files are streamed chunk by chunk (a first pass only counts
lines) and written into a temporary sibling directory that is renamed into place at
the end, so a failure (e.g. a malformed line) leaves nothing partial behind. With
``workers`` > 1 both passes run in worker processes over line-aligned units of the
inputs (:mod:`.parallel`), writing the same bytes. ``progress(stage, done, total, unit)``, when given, hears
of each finished piece of the three stages ("counting lines" in bytes, "parsing" in samples, "counting ids" in
tables; the last only with workers > 1, the serial pass counts while it parses); nothing here prints.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from concurrent.futures import FIRST_EXCEPTION, wait
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from . import parallel
from .avazu import AVAZU_NUM_CAT, AVAZU_NUM_DENSE, read_avazu_csv
from .configs import AVAZU, CRITEO_KAGGLE, DatasetConfig, criteo_1tb
from .criteo import (
    CRITEO_NUM_CAT,
    CRITEO_NUM_DENSE,
    DEFAULT_CHUNK_ROWS,
    RawChunk,
    open_binary,
    read_criteo_tsv,
)
from .synthetic import Progress  # progress(stage, done, total, unit), shared with the generators
from .transform import DENSE_TRANSFORM, count_into, dense_transform

__all__ = [
    "SPLITS",
    "FORMAT_VERSION",
    "DENSE_TRANSFORM",
    "dense_transform",
    "count_lines",
    "preprocess_files",
    "preprocess_criteo_kaggle",
    "preprocess_criteo_1tb",
    "preprocess_avazu",
    "load_metadata",
    "load_id_freq",
]

SPLITS = ("train", "val", "test")
FORMAT_VERSION = 1

_RAW_SHAPES = {"criteo_tsv": (CRITEO_NUM_DENSE, CRITEO_NUM_CAT), "avazu_csv": (AVAZU_NUM_DENSE, AVAZU_NUM_CAT)}
_READERS: dict[str, Callable[..., Iterator[RawChunk]]] = {
    "criteo_tsv": read_criteo_tsv,
    "avazu_csv": read_avazu_csv,
}
_HEADER_LINES = {"criteo_tsv": 0, "avazu_csv": 1}
_ID_FREQ = "train_id_freq.npy"
_ID_FREQ_OFFSETS = "train_id_freq_offsets.npy"


def count_lines(path: str | os.PathLike) -> int:
    """Number of lines in a file, counting a final line without ``\\n``; reads 16 MiB at a time."""
    return parallel.count_unit(parallel.Unit(os.fspath(path), 0, None, False))


def _check_config(config: DatasetConfig) -> None:
    want_dense, want_cat = _RAW_SHAPES[config.raw_format]
    if (config.num_dense, config.num_cat) != (want_dense, want_cat):
        raise ValueError(
            f"config {config.name!r} has {config.num_dense} dense / {config.num_cat} categorical features; "
            f"format {config.raw_format!r} produces {want_dense} / {want_cat}"
        )


def _new_array(tmp: Path, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
    path = tmp / name
    if math.prod(shape) == 0:
        # Zero-byte memmaps are not allowed; an empty split is a plain empty array.
        arr = np.zeros(shape, dtype=dtype)
        np.save(path, arr)
        return arr
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


def preprocess_files(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    config: DatasetConfig,
    plan: Callable[[list[int]], dict[str, int]],
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    overwrite: bool = False,
    workers: int | None = None,
    split_bytes: int = parallel.DEFAULT_SPLIT_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Preprocess ``inputs`` (read in order, as one stream of rows) into ``out_dir``.

    ``plan`` receives the data-row count of each input and returns the row count of
    each split in :data:`SPLITS` order; splits are consecutive ranges of the stream
    and must cover it exactly. Returns ``out_dir`` as a ``Path``.
    ``workers`` processes parse in parallel (default: all cores; 1 = this process alone), plain files cut
    into ~``split_bytes`` units (see :mod:`.parallel`); the output is the same bytes for any ``workers``.
    ``progress``: see the module docstring.
    """
    _check_config(config)
    workers = parallel.default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"preprocess_files: workers={workers!r}; expected an int >= 1 (or None: all cores)")
    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise ValueError("preprocess_files: expected at least one input file, got none")
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"preprocess_files: input {str(p)!r} is not a file")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"preprocess_files: output {str(out)!r} exists; pass overwrite=True to replace it")
    header = _HEADER_LINES[config.raw_format]
    counter = parallel.row_counter() if workers > 1 and progress is not None else None
    executor = parallel.pool(workers, counter) if workers > 1 else None
    try:
        return _preprocess(inputs, out, config, plan, chunk_rows, header, executor, workers, split_bytes,
                           progress or _no_progress, counter)
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def _no_progress(stage: str, done: int, total: int, unit: str) -> None:
    pass


def _preprocess(inputs, out, config, plan, chunk_rows, header, executor, workers, split_bytes, progress,
                counter) -> Path:
    file_bytes = [p.stat().st_size for p in inputs]
    total_bytes, done_bytes = sum(file_bytes), 0
    progress("counting lines", 0, total_bytes, "B")
    if executor is None:
        rows_per_file = []
        for p, size in zip(inputs, file_bytes):
            rows_per_file.append(max(count_lines(p) - header, 0))
            done_bytes += size
            progress("counting lines", done_bytes, total_bytes, "B")
    else:
        units = parallel.plan_units(inputs, header, split_bytes)
        flat = [u for file_units in units for u in file_units]
        unit_rows = []
        for u, rows in zip(flat, executor.map(parallel.count_unit, flat)):
            unit_rows.append(rows)
            done_bytes += (u.end if u.end is not None else os.path.getsize(u.path)) - u.start
            progress("counting lines", done_bytes, total_bytes, "B")
        per_file = np.cumsum([0] + [len(u) for u in units])
        rows_per_file = [int(sum(unit_rows[a:b])) for a, b in zip(per_file[:-1], per_file[1:])]
    total = sum(rows_per_file)
    split_rows = plan(rows_per_file)
    if set(split_rows) != set(SPLITS) or any(v < 0 for v in split_rows.values()) or sum(split_rows.values()) != total:
        raise ValueError(
            f"preprocess_files: split plan {split_rows} must give non-negative rows for {SPLITS} summing to {total}"
        )
    bounds = np.cumsum([0] + [split_rows[s] for s in SPLITS])
    sizes = np.asarray(config.table_sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would otherwise become the output's mode
        arrays = {
            s: (
                _new_array(tmp, f"{s}_dense.npy", np.float32, (split_rows[s], config.num_dense)),
                _new_array(tmp, f"{s}_sparse.npy", np.int64, (split_rows[s], config.num_cat)),
                _new_array(tmp, f"{s}_labels.npy", np.float32, (split_rows[s],)),
            )
            for s in SPLITS
        }
        freq = _new_array(tmp, _ID_FREQ, np.int64, (int(offsets[-1]),))
        np.save(tmp / _ID_FREQ_OFFSETS, offsets)
        progress("parsing", 0, total, "samples")
        if executor is not None:
            _fill_parallel(executor, workers, flat, unit_rows, tmp, config, bounds, offsets, chunk_rows, header,
                           progress, counter)
        read = _READERS[config.raw_format]
        pos = 0  # global row index of the next row
        for path, expected in zip(inputs if executor is None else [], rows_per_file):
            seen = 0
            for chunk in read(path, chunk_rows=chunk_rows):
                n = chunk.labels.shape[0]
                sparse = chunk.cats % sizes
                dense = dense_transform(chunk.dense)
                for k, split in enumerate(SPLITS):
                    lo, hi = max(pos, bounds[k]), min(pos + n, bounds[k + 1])
                    if lo >= hi:
                        continue
                    a, b = lo - pos, hi - pos
                    d_arr, s_arr, l_arr = arrays[split]
                    d_arr[lo - bounds[k] : hi - bounds[k]] = dense[a:b]
                    s_arr[lo - bounds[k] : hi - bounds[k]] = sparse[a:b]
                    l_arr[lo - bounds[k] : hi - bounds[k]] = chunk.labels[a:b]
                    if split == "train":
                        for f in range(config.num_cat):
                            count_into(freq[offsets[f] : offsets[f + 1]], sparse[a:b, f], int(sizes[f]))
                pos += n
                seen += n
                progress("parsing", pos, total, "samples")
            if seen != expected:
                raise RuntimeError(f"preprocess_files: {str(path)!r} had {expected} data lines when counted "
                                   f"but {seen} when read; was it modified during preprocessing?")
        for split in SPLITS:
            for arr in arrays[split]:
                if isinstance(arr, np.memmap):
                    arr.flush()
        if isinstance(freq, np.memmap):
            freq.flush()
        del arrays, freq
        meta = {
            "format_version": FORMAT_VERSION,
            "config": config.name,
            "raw_format": config.raw_format,
            "dense_names": list(config.dense_names),
            "cat_names": list(config.cat_names),
            "table_sizes": [int(s) for s in config.table_sizes],
            "embedding_dim": config.embedding_dim,
            "rows": {s: int(split_rows[s]) for s in SPLITS},
            "dense_transform": DENSE_TRANSFORM,
            "sources": [{"path": str(p.resolve()), "rows": r} for p, r in zip(inputs, rows_per_file)],
        }
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            # overwrite=True: move the old output aside first so a rename failure keeps it.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "d")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _fill_parallel(executor, workers: int, units, unit_rows, tmp: Path, config: DatasetConfig, bounds, offsets,
                   chunk_rows: int, header: int, progress: Progress, counter) -> None:
    """Rows by unit (each worker writes its own rows), then train id counts by feature group. `counter` (or None):
    the workers' shared count of rows written, polled for progress while the units run."""
    tasks, row, line = [], 0, 1
    for unit, rows in zip(units, unit_rows):
        line = 1 if unit.start == 0 else line  # a new file starts at line 1
        tasks.append(parallel.FillTask(unit, config.raw_format, line + (header if unit.skip_header else 0), row,
                                       str(tmp), tuple(int(b) for b in bounds), SPLITS,
                                       tuple(int(s) for s in config.table_sizes), chunk_rows))
        row, line = row + rows, line + rows + (header if unit.skip_header else 0)
    total = int(bounds[-1])
    futures = [executor.submit(parallel.fill_unit, task) for task in tasks]
    pending = set(futures)
    while pending and counter is not None:
        done, pending = wait(pending, timeout=0.25, return_when=FIRST_EXCEPTION)
        progress("parsing", min(counter.value, total), total, "samples")
        if any(f.exception() is not None for f in done):
            break  # raised below, in unit order
    for task, rows, future in zip(tasks, unit_rows, futures):
        written = future.result()
        if written != rows:
            raise RuntimeError(f"preprocess_files: {task.unit.path!r} bytes {task.unit.start}..{task.unit.end} had "
                               f"{rows} data lines when counted but {written} when read; was it modified during "
                               "preprocessing?")
    progress("parsing", total, total, "samples")
    n_train = int(bounds[1] - bounds[0])
    if n_train:
        groups = parallel.balance_features(config.table_sizes, workers)
        jobs = [(str(tmp / "train_sparse.npy"), str(tmp / _ID_FREQ), g, tuple(int(o) for o in offsets))
                for g in groups]
        progress("counting ids", 0, config.num_cat, "tables")
        tables = 0
        for job, _ in zip(jobs, executor.map(parallel.count_features, jobs)):
            tables += len(job[2])
            progress("counting ids", tables, config.num_cat, "tables")


def _check_fractions(train_fraction: float, val_fraction: float) -> None:
    if not (0.0 < train_fraction <= 1.0) or not (0.0 <= val_fraction <= 1.0) or train_fraction + val_fraction > 1.0:
        raise ValueError(
            f"train_fraction={train_fraction!r}, val_fraction={val_fraction!r}; expected 0 < train, 0 <= val, "
            f"train + val <= 1 (the rest is test)"
        )


def _fraction_plan(train_fraction: float, val_fraction: float) -> Callable[[list[int]], dict[str, int]]:
    _check_fractions(train_fraction, val_fraction)

    def plan(rows: list[int]) -> dict[str, int]:
        total = sum(rows)
        n_train = int(total * train_fraction)
        n_val = min(int(total * val_fraction), total - n_train)
        return {"train": n_train, "val": n_val, "test": total - n_train - n_val}

    return plan


def preprocess_criteo_kaggle(
    train_txt: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: DatasetConfig = CRITEO_KAGGLE,
    train_fraction: float = 6 / 7,
    val_fraction: float = 1 / 14,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    overwrite: bool = False,
    workers: int | None = None,
    split_bytes: int = parallel.DEFAULT_SPLIT_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Kaggle convention: the 7 days of ``train.txt`` in order; the first 6/7 of lines are
    train, the last 1/7 is split in half, val then test (the rest after val is test)."""
    return preprocess_files([train_txt], out_dir, config, _fraction_plan(train_fraction, val_fraction),
                            chunk_rows=chunk_rows, overwrite=overwrite, workers=workers,
                            split_bytes=split_bytes, progress=progress)


def preprocess_criteo_1tb(
    day_files: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    config: DatasetConfig | None = None,
    val_fraction_of_last_day: float = 0.5,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    overwrite: bool = False,
    workers: int | None = None,
    split_bytes: int = parallel.DEFAULT_SPLIT_BYTES,
    progress: Progress | None = None,
) -> Path:
    """1TB convention: ``day_files`` in day order; all but the last are train, the last day
    is split into val (first ``val_fraction_of_last_day`` of it) and test.
    ``config`` defaults to :func:`criteo_1tb` (tables capped at 40M rows)."""
    if len(day_files) < 2:
        raise ValueError(f"preprocess_criteo_1tb: got {len(day_files)} day file(s); expected >= 2 "
                         "(train days, then the val/test day)")
    if not (0.0 <= val_fraction_of_last_day <= 1.0):
        raise ValueError(f"val_fraction_of_last_day={val_fraction_of_last_day!r}; expected within [0, 1]")

    def plan(rows: list[int]) -> dict[str, int]:
        n_val = int(rows[-1] * val_fraction_of_last_day)
        return {"train": sum(rows[:-1]), "val": n_val, "test": rows[-1] - n_val}

    return preprocess_files(day_files, out_dir, config or criteo_1tb(), plan,
                            chunk_rows=chunk_rows, overwrite=overwrite, workers=workers,
                            split_bytes=split_bytes, progress=progress)


def preprocess_avazu(
    csv_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: DatasetConfig = AVAZU,
    train_fraction: float = 0.8,
    val_fraction: float = 0.1,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    overwrite: bool = False,
    workers: int | None = None,
    split_bytes: int = parallel.DEFAULT_SPLIT_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Avazu: rows in file (time) order; first ``train_fraction`` train, next
    ``val_fraction`` val, the rest test."""
    return preprocess_files([csv_path], out_dir, config, _fraction_plan(train_fraction, val_fraction),
                            chunk_rows=chunk_rows, overwrite=overwrite, workers=workers,
                            split_bytes=split_bytes, progress=progress)


def load_metadata(data_dir: str | os.PathLike) -> dict:
    """The ``metadata.json`` of a preprocessed directory, checked for a known format version."""
    path = Path(data_dir) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found; expected a directory written by preprocess_files")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r}: format_version={meta.get('format_version')!r}; expected {FORMAT_VERSION}")
    return meta


def load_id_freq(data_dir: str | os.PathLike) -> list[np.ndarray]:
    """Per-feature train id counts: one int64 array per feature, length = its table size
    (read-only memory-mapped views of one file)."""
    data_dir = Path(data_dir)
    offsets = np.load(data_dir / _ID_FREQ_OFFSETS)
    freq = np.load(data_dir / _ID_FREQ, mmap_mode="r")
    if int(offsets[-1]) != freq.shape[0]:
        raise ValueError(f"{str(data_dir / _ID_FREQ)!r} has {freq.shape[0]} entries; offsets expect {int(offsets[-1])}")
    return [freq[offsets[f] : offsets[f + 1]] for f in range(offsets.shape[0] - 1)]
