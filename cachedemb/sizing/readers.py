"""Id traces per table from what users have: a preprocessed recipe data directory, raw id files (`.npy` /
`.npz`, or a directory of them), an iterable of model inputs (torchrec KeyedJaggedTensors, dicts
{feature: (values, offsets)}, 2-D id tensors [batch, features], or nn.EmbeddingBag's `(input, offsets)`), or
arrays.

Every reader yields one dict {table: ids of the batch} per batch; `collect` turns the stream into a `TableTrace`
per table, sampling as it goes (`shards`), so a trace larger than memory is read once and never held whole.
torchrec is not imported: a KeyedJaggedTensor is recognized by its methods.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from cachedemb.sizing.shards import TableTrace, TraceBuilder

#: The preprocessed format of `cachedemb.recipes.dlrm.data.preprocess` that this reader understands.
DATA_DIR_FORMAT_VERSION = 1


def _numpy(ids, where: str) -> np.ndarray:
    if torch.is_tensor(ids):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{where}: ids must be an integer tensor, got {ids.dtype}")
        return ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


def feature_tables(tables) -> dict[str, list[str]]:
    """{feature: names of the tables that look it up} from TableConfigs / torchrec EmbeddingBagConfigs /
    TableSpecs (anything with `name` and `feature_names`; no feature names: the table's own name)."""
    out: dict[str, list[str]] = {}
    for t in tables:
        names = list(getattr(t, "feature_names", None) or (t.name,))
        for f in names:
            out.setdefault(f, []).append(t.name)
    return out


def _is_kjt(obj) -> bool:
    return all(hasattr(obj, m) for m in ("keys", "values", "offsets", "stride", "offset_per_key"))


def batch_ids(batch, features: dict[str, list[str]] | None) -> dict[str, np.ndarray]:
    """One batch's ids per table. ``features`` maps each feature to its tables (None: a single-table input,
    or features named as their tables)."""
    per_feature: dict[str, np.ndarray] = {}
    if _is_kjt(batch):
        keys, values = list(batch.keys()), batch.values()
        offs = batch.offset_per_key()
        for i, k in enumerate(keys):
            per_feature[k] = _numpy(values[offs[i]:offs[i + 1]], f"feature {k!r}")
    elif isinstance(batch, Mapping):
        for k, item in batch.items():
            if all(hasattr(item, m) for m in ("values", "offsets")) and not isinstance(item, (tuple, list)):
                per_feature[k] = _numpy(item.values(), f"feature {k!r}")  # a torchrec JaggedTensor
            elif isinstance(item, (tuple, list)) and len(item) in (2, 3):  # (values, offsets or lengths[, w])
                per_feature[k] = _numpy(item[0], f"feature {k!r}")
            else:
                per_feature[k] = _numpy(item, f"feature {k!r}")
    elif isinstance(batch, (tuple, list)) and batch and (torch.is_tensor(batch[0]) or
                                                         isinstance(batch[0], np.ndarray)):
        # nn.EmbeddingBag's (input, offsets[, per_sample_weights]): one table
        return {_single(features): _numpy(batch[0], "input")}
    elif torch.is_tensor(batch) or isinstance(batch, np.ndarray):
        names = list(features) if features is not None else None
        if names is not None and len(names) > 1:
            if batch.ndim != 2 or batch.shape[1] != len(names):
                raise ValueError(f"a tensor input must be 2-D [batch, {len(names)}] (one id per feature in "
                                 f"{names}), got shape {tuple(batch.shape)}")
            for j, k in enumerate(names):
                per_feature[k] = _numpy(batch[:, j], f"feature {k!r}")
        else:
            return {_single(features): _numpy(batch, "input")}
    else:
        raise TypeError("a batch must be a torchrec KeyedJaggedTensor, a dict {feature: (values, offsets)}, a 2-D "
                        f"id tensor [batch, features] or an (input, offsets) tuple, got {type(batch).__name__}")
    if features is None:
        return per_feature
    missing = [f for f in features if f not in per_feature]
    if missing:
        raise ValueError(f"missing feature(s) {missing} in a batch with keys {sorted(per_feature)}")
    out: dict[str, list[np.ndarray]] = {}
    for f, names in features.items():
        for name in names:
            out.setdefault(name, []).append(per_feature[f])
    return {name: np.concatenate(parts) for name, parts in out.items()}


def _single(features) -> str:
    if features is None:
        return "table"
    names = {t for ts in features.values() for t in ts}
    if len(names) != 1:
        raise ValueError(f"an (input, offsets) batch feeds one table, but the tables are {sorted(names)}: pass "
                         "dicts or KeyedJaggedTensors keyed by feature")
    return next(iter(names))


def read_batches(batches: Iterable, tables=None, *, ids=None,
                 limit_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Per batch {table: ids}. ``tables`` (configs with `name` / `feature_names`) map features to tables;
    ``ids(batch)`` extracts the model input from a batch first (e.g. ``lambda b: b.sparse``)."""
    features = feature_tables(tables) if tables is not None else None
    for k, batch in enumerate(batches):
        if limit_batches is not None and k >= limit_batches:
            return
        yield batch_ids(ids(batch) if ids is not None else batch, features)


def read_arrays(arrays) -> Iterator[dict[str, np.ndarray]]:
    """Per batch {table: ids} from {table: batches} (each a list of 1-D arrays or a 2-D array, one row per
    batch; every table the same number of batches), or one table's batches."""
    if not isinstance(arrays, Mapping):
        arrays = {"table": arrays}
    lists = {name: list(b) for name, b in arrays.items()}
    counts = {name: len(b) for name, b in lists.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"every table needs the same number of batches, got {counts}")
    for k in range(next(iter(counts.values()), 0)):
        yield {name: _numpy(b[k], f"table {name!r} batch {k}") for name, b in lists.items()}


def collect(stream: Iterable[Mapping[str, np.ndarray]], *, sample_rate: float = 1.0,
            max_unique: int | None = None, salt: int = 0) -> dict[str, TableTrace]:
    """One `TableTrace` per table of a stream of {table: ids} batches (every batch names every table)."""
    builders: dict[str, TraceBuilder] = {}
    for k, batch in enumerate(stream):
        if not builders:
            builders = {name: TraceBuilder(sample_rate, max_unique, salt) for name in batch}
        elif set(batch) != set(builders):
            raise ValueError(f"batch {k} has tables {sorted(batch)}, the first had {sorted(builders)}")
        for name, ids in batch.items():
            builders[name].add(ids)
    return {name: b.build() for name, b in builders.items()}


# ------------------------------------------------------------------------------- preprocessed recipe data


class DataDir:
    """A directory written by the DLRM recipe's preprocessing (`metadata.json`, `<split>_sparse.npy` [rows,
    features] int64 memory-mapped, `train_id_freq*.npy`): tables named `t_<feature>` as the recipe's DLRM names
    them, batches served in the recipe's order."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        meta_path = self.path / "metadata.json"
        if not meta_path.is_file():
            nested = self.path / "preprocessed" / "metadata.json"
            if nested.is_file():
                self.path, meta_path = self.path / "preprocessed", nested
            else:
                raise FileNotFoundError(f"{str(meta_path)!r} not found; expected a directory preprocessed by the "
                                        "DLRM recipe (python -m cachedemb.recipes.dlrm.main --data-dir ...)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format_version") != DATA_DIR_FORMAT_VERSION:
            raise ValueError(f"{str(meta_path)!r}: format_version={self.meta.get('format_version')!r}; expected "
                             f"{DATA_DIR_FORMAT_VERSION}")
        self.features = list(self.meta["cat_names"])
        self.table_names = [f"t_{f}" for f in self.features]
        self.table_sizes = [int(s) for s in self.meta["table_sizes"]]
        self.embedding_dim = int(self.meta.get("embedding_dim", 0)) or None

    def sparse(self, split: str = "train") -> np.ndarray:
        path = self.path / f"{split}_sparse.npy"
        if not path.is_file():
            raise FileNotFoundError(f"{str(path)!r} not found; expected the {split!r} split of the preprocessed data")
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 2 or arr.shape[1] != len(self.features) or arr.dtype != np.int64:
            raise ValueError(f"{str(path)!r}: {arr.dtype} shape {arr.shape}; expected int64 [rows, "
                             f"{len(self.features)}]")
        return arr

    def batch_order(self, rows: int, batch_size: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
        """The recipe loader's order (PreprocessedSplit.batch_order): batch indices, permuted per (seed, epoch)."""
        count = -(-rows // batch_size)
        return np.random.default_rng([int(seed), int(epoch)]).permutation(count) if shuffle else np.arange(count)

    def batches(self, batch_size: int, *, split: str = "train", shuffle: bool = True, seed: int = 0,
                epoch: int = 0, limit_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Per batch {table: ids}, in the order the recipe trains them (``shuffle``, ``seed``, ``epoch`` as its
        --seed and epoch) ."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        sparse = self.sparse(split)
        order = self.batch_order(sparse.shape[0], batch_size, shuffle, seed, epoch)
        if limit_batches is not None:
            order = order[:limit_batches]
        for b in order:
            block = np.asarray(sparse[b * batch_size:(b + 1) * batch_size])
            yield {name: block[:, j] for j, name in enumerate(self.table_names)}

    def id_freq(self) -> dict[str, np.ndarray]:
        """The train split's id counts per table (the recipe's `id_freq`, its LFU warm start)."""
        offsets = np.load(self.path / "train_id_freq_offsets.npy")
        freq = np.load(self.path / "train_id_freq.npy", mmap_mode="r")
        return {name: np.asarray(freq[offsets[j]:offsets[j + 1]]) for j, name in enumerate(self.table_names)}


# ------------------------------------------------------------------------------------------- raw id files


class IdFiles:
    """Raw ids per table, one id per sample: a ``.npy`` (one table named by its file stem), an ``.npz`` (a table
    per array, named by its key) or a directory of them (its ``*.npy`` and ``*.npz``, by name). An array is
    ``[samples]`` (one table) or ``[samples, k]`` (k tables, ``<name>_0`` .. ``<name>_<k-1>``); ids are
    non-negative integers and every table has the same samples, batched in file order.

    Everything is checked on opening (dtype, shape, signs, rows), before any sizing starts; a bad file raises
    ValueError (FileNotFoundError for a missing path) naming it and what was expected.

    Args:
        path: the file or directory.
        num_rows: rows per table: an int for every table, {table: rows} (tables not named are inferred), or
            None: each table's max id + 1 (`rows_given` says which).
    """

    SUFFIXES = (".npy", ".npz")

    def __init__(self, path: str | os.PathLike, num_rows: int | Mapping[str, int] | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{str(self.path)!r} not found; expected a .npy or .npz of ids, a directory of "
                                    "them, or a directory preprocessed by the DLRM recipe")
        if self.path.is_dir():
            files = sorted(f for f in self.path.iterdir() if f.suffix in self.SUFFIXES and f.is_file())
            if not files:
                raise ValueError(f"{str(self.path)!r} holds no .npy or .npz files (and no metadata.json of a "
                                 "recipe-preprocessed directory); expected one id file per table")
        elif self.path.suffix in self.SUFFIXES:
            files = [self.path]
        else:
            raise ValueError(f"{str(self.path)!r}: expected a .npy or .npz of ids, a directory of them, or a "
                             f"directory preprocessed by the DLRM recipe; got a {self.path.suffix or 'suffix-less'} "
                             "file")
        self.columns: dict[str, tuple[np.ndarray, int | None, Path]] = {}  # table: (array, column or None, file)
        self.max_ids: dict[str, int] = {}
        for f in files:
            for name, arr in self._arrays(f):
                self._add(name, arr, f)
        samples = {n: a.shape[0] for n, (a, _, _) in self.columns.items()}
        if len(set(samples.values())) > 1:
            raise ValueError(f"{str(self.path)!r}: every table needs the same number of samples (one id per sample "
                             f"each), got {samples}")
        self.num_samples = next(iter(samples.values()))
        self.table_names = list(self.columns)
        self.table_sizes, self.rows_given = self._rows(num_rows)
        self.embedding_dim = None

    @staticmethod
    def _arrays(f: Path):
        try:
            loaded = np.load(f, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy raises several kinds for a corrupt or foreign file
            raise ValueError(f"{str(f)!r} is not a readable {f.suffix} file ({type(e).__name__}: {e})") from None
        if isinstance(loaded, np.ndarray):
            return [(f.stem, loaded)]
        with loaded:
            if not loaded.files:
                raise ValueError(f"{str(f)!r} holds no arrays; expected one array of ids per table")
            return [(k, loaded[k]) for k in loaded.files]

    def _add(self, name: str, arr: np.ndarray, f: Path) -> None:
        what = f"{str(f)!r}" + (f" array {name!r}" if f.suffix == ".npz" else "")
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what}: ids must be integers (row indices), got dtype {arr.dtype}; cast them, e.g. "
                             "np.save(path, ids.astype(np.int64))")
        if arr.ndim not in (1, 2) or arr.shape[0] == 0 or (arr.ndim == 2 and not 1 <= arr.shape[1] <= arr.shape[0]):
            hint = " (more tables than samples: transpose it)" if arr.ndim == 2 and arr.shape[1] > arr.shape[0] else ""
            raise ValueError(f"{what}: shape {arr.shape}; expected [samples] (one table) or [samples, tables], "
                             f"with at least one sample{hint}")
        names = [name] if arr.ndim == 1 else [name] if arr.shape[1] == 1 else [f"{name}_{j}"
                                                                                   for j in range(arr.shape[1])]
        lo, hi = np.atleast_1d(arr.min(axis=0)), np.atleast_1d(arr.max(axis=0))  # one pass over the file
        for j, n in enumerate(names):
            if lo[j] < 0:
                raise ValueError(f"{what}: table {n!r} has id {int(lo[j])}; expected non-negative integer ids "
                                 "(row indices)")
            if n in self.columns:
                raise ValueError(f"{what}: table {n!r} is also in {str(self.columns[n][2])!r}; expected distinct "
                                 "table names (file stems, .npz keys)")
            self.columns[n] = (arr, None if arr.ndim == 1 else j, f)
            self.max_ids[n] = int(hi[j])

    def _rows(self, num_rows) -> tuple[list[int], dict[str, bool]]:
        if num_rows is None:
            given = {}
        elif isinstance(num_rows, Mapping):
            unknown = sorted(set(num_rows) - set(self.table_names))
            if unknown:
                raise ValueError(f"rows given for unknown table(s) {unknown}; the tables are {self.table_names}")
            given = dict(num_rows)
        else:
            given = {n: num_rows for n in self.table_names}
        sizes = []
        for n in self.table_names:
            rows = given.get(n)
            if rows is None:
                sizes.append(self.max_ids[n] + 1)
                continue
            if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
                raise ValueError(f"rows of table {n!r} must be a positive int, got {rows!r}")
            if self.max_ids[n] >= rows:
                raise ValueError(f"{str(self.columns[n][2])!r}: table {n!r} has id {self.max_ids[n]}, outside its "
                                 f"{rows} rows; expected ids in [0, {rows})")
            sizes.append(int(rows))
        return sizes, {n: n in given for n in self.table_names}

    def batches(self, batch_size: int, *, limit_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Per batch {table: ids} of ``batch_size`` samples, in file order (the last batch may be short)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        count = -(-self.num_samples // batch_size)
        if limit_batches is not None:
            count = min(count, limit_batches)
        for b in range(count):
            sl = slice(b * batch_size, (b + 1) * batch_size)
            yield {n: np.asarray(a[sl] if col is None else a[sl, col], dtype=np.int64)
                   for n, (a, col, _) in self.columns.items()}


def open_path(path: str | os.PathLike, num_rows=None) -> "DataDir | IdFiles":
    """A recipe-preprocessed directory (it, or its parent, holds `metadata.json`) as `DataDir`, else raw id files
    (`IdFiles`). ``num_rows`` applies to raw ids only."""
    p = Path(path)
    if p.is_dir() and ((p / "metadata.json").is_file() or (p / "preprocessed" / "metadata.json").is_file()):
        if num_rows is not None:
            raise ValueError(f"{str(p)!r} is a recipe-preprocessed directory: its metadata.json gives the rows per "
                             "table; rows are set only for raw ids")
        return DataDir(p)
    return IdFiles(p, num_rows)


__all__ = ["DataDir", "IdFiles", "batch_ids", "collect", "feature_tables", "open_path", "read_arrays",
           "read_batches"]
