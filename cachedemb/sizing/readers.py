"""Id traces per table from what users have: a preprocessed recipe data directory, an iterable of model inputs
(torchrec KeyedJaggedTensors, dicts {feature: (values, offsets)}, 2-D id tensors [batch, features], or
nn.EmbeddingBag's `(input, offsets)`), or arrays.

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


__all__ = ["DataDir", "batch_ids", "collect", "feature_tables", "read_arrays", "read_batches"]
