"""`plan`: from id traces to cache rows per table for a device-memory budget, with the predictions.

Steps: read a `TableTrace` per table (`readers`); compute each table's miss-ratio curve under the policy the
module will run (plus any others to compare); split the budget over the tables (`split`); refine each table's
curve around its chosen size and split again; then predict each cache the module will build: a
CachedEmbeddingBagCollection groups tables of the same (dim, pooling, dtype) into one cache, whose rows are the
sum of its tables' rows, and that shared cache is simulated on the group's merged trace (its prediction is what
the module measures; the per-table figures are each table's own cache of its rows).

Bytes: a cached row costs its row, its optimizer state and `SLOT_METADATA_BYTES` of slot metadata in device
memory (the budget); a moved row carries its row, its state and its access count over PCIe (`cache_stats()`'s
`bytes_in` per row). With a host budget (the file tier) a second split sizes each table's host cache (at least
its device rows) against the bytes read from the file per step.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cachedemb.sizing import readers
from cachedemb.sizing.curves import POLICIES, MissRatioCurve, WarmStart, default_sizes, miss_ratio_curve
from cachedemb.sizing.shards import TableTrace, merge
from cachedemb.sizing.split import Split, TableCost, split_budget

#: Device bytes per cached row beside its row and optimizer state, an upper bound over cache sizes: slot id,
#: count, last use, next use (8 B each), dirty, protected and hit flags (1 B each), a victim-pool candidate (8 B)
#: and the id index (a power-of-two table of >= 2 positions per row, 8 B each: at most 32 B per row).
SLOT_METADATA_BYTES = 75
#: Bytes a moved row carries beside its row and state: its access count (cache_stats()["bytes_in"]).
COUNT_BYTES = 8
#: Kept per-batch distinct ids per table under which a trace stays exact with ``max_unique="auto"``.
AUTO_MAX_UNIQUE = 1 << 20


@dataclass(frozen=True)
class TableSpec:
    """What sizing needs to know of a table: its rows, and the bytes a cached or moved row costs."""

    name: str
    num_embeddings: int | None
    embedding_dim: int
    dtype: torch.dtype = torch.float32
    state_cols: int = 0  # optimizer state values per row (float32; float64 for a float64 table)
    pooling: str = "sum"
    feature_names: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.embedding_dim, bool) or not isinstance(self.embedding_dim, int) or self.embedding_dim < 1:
            raise ValueError(f"table {self.name!r}: embedding_dim must be a positive int, got {self.embedding_dim!r}")
        if self.num_embeddings is not None and (isinstance(self.num_embeddings, bool) or
                                                int(self.num_embeddings) < 1):
            raise ValueError(f"table {self.name!r}: num_embeddings must be a positive int or None, got "
                             f"{self.num_embeddings!r}")

    @property
    def row_bytes(self) -> int:
        return self.embedding_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def state_bytes(self) -> int:
        return self.state_cols * (8 if self.dtype == torch.float64 else 4)

    @property
    def transfer_bytes(self) -> int:
        """PCIe bytes per row moved host -> device."""
        return self.row_bytes + self.state_bytes + COUNT_BYTES

    @property
    def device_row_bytes(self) -> int:
        """Device bytes per cached row (the budget's unit)."""
        return self.row_bytes + self.state_bytes + SLOT_METADATA_BYTES

    @property
    def host_row_bytes(self) -> int:
        """Host bytes per row of a host cache in front of a file (row, state, count)."""
        return self.row_bytes + self.state_bytes + COUNT_BYTES

    @classmethod
    def from_config(cls, config, optimizer=None) -> "TableSpec":
        """From a TableConfig, a torchrec EmbeddingBagConfig (duck-typed) or a TableSpec; ``optimizer`` (a
        `cachedemb.optim` spec) sets the state per row."""
        if isinstance(config, cls):
            return config if optimizer is None else cls(**{**config.__dict__,
                                                           "state_cols": state_cols(optimizer, config.embedding_dim)})
        missing = [a for a in ("name", "num_embeddings", "embedding_dim") if not hasattr(config, a)]
        if missing:
            raise TypeError(f"tables must be TableSpec, TableConfig or torchrec EmbeddingBagConfig, got "
                            f"{type(config).__name__} without {missing}")
        dtype = getattr(config, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            data_type = getattr(config, "data_type", None)
            key = str(getattr(data_type, "name", data_type or "FP32")).upper()
            dtype = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}.get(key, torch.float32)
        pooling = getattr(config, "pooling", "sum")
        pooling = str(getattr(pooling, "value", pooling)).lower()
        dim = int(config.embedding_dim)
        return cls(config.name, config.num_embeddings, dim, dtype, state_cols(optimizer, dim), pooling,
                   tuple(getattr(config, "feature_names", None) or (config.name,)))


def state_cols(optimizer, dim: int) -> int:
    """Optimizer state values per row of a `cachedemb.optim` spec (None: no state)."""
    if optimizer is None:
        return 0
    layout = getattr(optimizer, "state_layout", None)
    if layout is None:
        raise TypeError(f"optimizer must be a cachedemb.optim spec (SGD, Adagrad, RowWiseAdagrad, Adam) or None, got "
                        f"{type(optimizer).__name__}")
    return int(sum(cols for cols, _ in layout(dim).values()))


@dataclass
class TablePlan:
    """One table's cache: its rows, the predictions at them (its own cache of these rows), its curves."""

    spec: TableSpec
    cache_rows: int
    curves: dict[str, MissRatioCurve]  # the split policy's first
    policy: str
    group: int
    host_rows: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def curve(self) -> MissRatioCurve:
        return self.curves[self.policy]

    @property
    def miss_ratio(self) -> float:
        return self.curve.miss_ratio_at(self.cache_rows)

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.miss_ratio

    @property
    def rows_per_batch(self) -> float:
        return self.curve.rows_per_batch_at(self.cache_rows)

    @property
    def pcie_bytes_per_step(self) -> float:
        return self.rows_per_batch * self.spec.transfer_bytes

    @property
    def device_bytes(self) -> int:
        return self.cache_rows * self.spec.device_row_bytes

    @property
    def file_bytes_per_step(self) -> float | None:
        if self.host_rows is None:
            return None
        return self.curve.rows_per_batch_at(self.host_rows) * self.spec.transfer_bytes

    def to_dict(self) -> dict:
        out = {"table": self.name, "num_embeddings": self.spec.num_embeddings, "embedding_dim": self.spec.embedding_dim,
               "group": self.group, "cache_rows": self.cache_rows,
               "cache_ratio": (self.cache_rows / self.spec.num_embeddings) if self.spec.num_embeddings else None,
               "predicted_hit_rate": round(self.hit_rate, 6), "predicted_miss_ratio": round(self.miss_ratio, 6),
               "rows_per_batch": round(self.rows_per_batch, 3),
               "pcie_bytes_per_step": round(self.pcie_bytes_per_step, 1), "device_bytes": self.device_bytes,
               "device_row_bytes": self.spec.device_row_bytes, "transfer_bytes_per_row": self.spec.transfer_bytes,
               "curves": {name: c.to_dict() for name, c in self.curves.items()}}
        if self.host_rows is not None:
            out.update(host_rows=self.host_rows, file_bytes_per_step=round(self.file_bytes_per_step, 1))
        return out


@dataclass
class GroupPlan:
    """One cache the module builds (a collection group, or a lone table): rows = its tables' rows summed, and
    the prediction of that shared cache on the tables' merged trace."""

    tables: tuple[str, ...]
    cache_rows: int
    miss_ratio: float
    rows_per_batch: float
    pcie_bytes_per_step: float
    stderr: float = 0.0

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.miss_ratio

    def to_dict(self) -> dict:
        return {"tables": list(self.tables), "cache_rows": self.cache_rows,
                "predicted_hit_rate": round(self.hit_rate, 6), "predicted_miss_ratio": round(self.miss_ratio, 6),
                "rows_per_batch": round(self.rows_per_batch, 3),
                "pcie_bytes_per_step": round(self.pcie_bytes_per_step, 1), "stderr": round(self.stderr, 6)}


@dataclass
class SizingPlan:
    """Cache rows per table (`cache_rows`, what CachedEmbeddingBagCollection takes) and per cache group, with
    the predicted hit rates and PCIe bytes per step."""

    tables: list[TablePlan]
    groups: list[GroupPlan]
    budget_bytes: int
    split: Split
    policy: str
    options: dict = field(default_factory=dict)
    host_budget_bytes: int | None = None
    host_split: Split | None = None

    @property
    def cache_rows(self) -> dict[str, int]:
        return {t.name: t.cache_rows for t in self.tables}

    @property
    def host_rows(self) -> dict[str, int] | None:
        return None if self.host_split is None else {t.name: t.host_rows for t in self.tables}

    @property
    def budget_used(self) -> int:
        return sum(t.device_bytes for t in self.tables)

    @property
    def pcie_bytes_per_step(self) -> float:
        """The caches' predicted PCIe bytes per step (shared group caches as the module builds them)."""
        return sum(g.pcie_bytes_per_step for g in self.groups)

    @property
    def hit_rate(self) -> float:
        """Predicted share of each batch's distinct ids served without a row moved, over all caches."""
        unique = sum(self.table(n).curve.unique_per_batch for g in self.groups for n in g.tables)
        return 1.0 - sum(g.rows_per_batch for g in self.groups) / unique if unique else float("nan")

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table {name!r}; tables are {[t.name for t in self.tables]}")

    def cache_statistics(self, name: str):
        """The table's curve as torchrec's planner takes cache statistics (`CacheParams(stats=...)`)."""
        from cachedemb.sizing.torchrec_stats import CurveCacheStatistics

        t = self.table(name)
        return CurveCacheStatistics(t.curve, t.spec.num_embeddings or t.curve.distinct_ids)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "options": dict(self.options), "budget_bytes": self.budget_bytes,
                "budget_used": self.budget_used, "predicted_hit_rate": round(self.hit_rate, 6),
                "pcie_bytes_per_step": round(self.pcie_bytes_per_step, 1),
                "split": {"bytes_per_step": round(self.split.bytes_moved, 1),
                          "lower_bound": round(self.split.lower_bound, 1), "optimal": self.split.optimal,
                          "nodes": self.split.nodes},
                "host_budget_bytes": self.host_budget_bytes,
                "groups": [g.to_dict() for g in self.groups], "tables": [t.to_dict() for t in self.tables]}

    def format_table(self) -> str:
        from cachedemb.sizing.report import format_table

        return format_table(self)

    def plot(self, path: str | Path, curve=None) -> Path:
        """The PNG (`report.plot`); ``curve``: the `BudgetCurve` this plan was chosen from, drawn first."""
        from cachedemb.sizing.report import plot

        return plot(self, path, curve)


# ------------------------------------------------------------------------------------------ inputs


def read_traces(source, tables=None, *, batch_size: int | None = None, limit_batches: int | None = None,
                shuffle: bool = True, seed: int = 0, epoch: int = 0, ids=None, sample_rate: float = 1.0,
                max_unique: int | str | None = "auto", salt: int = 0) -> dict[str, TableTrace]:
    """A `TableTrace` per table from ``source``: a preprocessed recipe directory (``batch_size`` rows a batch,
    in the recipe's order for ``seed``/``epoch``), raw id files (a ``.npy`` / ``.npz`` or a directory of them,
    `readers.IdFiles`; ``batch_size`` samples a batch, in file order), {table: batches} arrays or one table's
    batches, or an iterable of model inputs (KeyedJaggedTensor, dict, 2-D tensor, (input, offsets);
    ``ids(batch)`` picks the input out of a batch). ``tables`` map features to tables. ``max_unique="auto"`` samples a table whose kept per-batch
    distinct ids pass `AUTO_MAX_UNIQUE`."""
    if isinstance(max_unique, str):
        if max_unique != "auto":
            raise ValueError(f"max_unique must be 'auto', None or a positive int, got {max_unique!r}")
        max_unique = AUTO_MAX_UNIQUE
    if isinstance(source, Mapping) and source and all(isinstance(v, TableTrace) for v in source.values()):
        return dict(source)
    if isinstance(source, (str, Path, readers.DataDir, readers.IdFiles)):
        data = readers.open_path(source) if isinstance(source, (str, Path)) else source
        if batch_size is None:
            raise ValueError("reading a data directory or id files needs batch_size (the training batch size)")
        if isinstance(data, readers.IdFiles):
            stream = data.batches(batch_size, limit_batches=limit_batches)
        else:
            stream = data.batches(batch_size, shuffle=shuffle, seed=seed, epoch=epoch, limit_batches=limit_batches)
    elif isinstance(source, Mapping) and all(isinstance(v, (list, tuple, np.ndarray)) for v in source.values()):
        stream = readers.read_arrays(source)
    elif isinstance(source, np.ndarray) or (isinstance(source, (list, tuple)) and source and
                                            all(isinstance(b, np.ndarray) for b in source)):
        stream = readers.read_arrays(source)
    else:
        stream = readers.read_batches(source, tables, ids=ids, limit_batches=limit_batches)
    traces = readers.collect(stream, sample_rate=sample_rate, max_unique=max_unique, salt=salt)
    if not traces:
        raise ValueError("the source yielded no batches")
    return traces


def _specs(tables, traces: Mapping[str, TableTrace], data, optimizer, embedding_dim) -> list[TableSpec]:
    if tables is None and isinstance(data, readers.DataDir):
        dim = embedding_dim or data.embedding_dim
        tables = [TableSpec(n, s, int(dim), feature_names=(f,))
                  for n, s, f in zip(data.table_names, data.table_sizes, data.features)]
    if tables is None and isinstance(data, readers.IdFiles):
        if embedding_dim is None:
            raise ValueError("raw id files do not record the embedding dim: pass embedding_dim= (CLI: "
                             "--embedding-dim) so the split knows each row's bytes")
        tables = [TableSpec(n, s, int(embedding_dim)) for n, s in zip(data.table_names, data.table_sizes)]
    if tables is None:
        if embedding_dim is None:
            raise ValueError("pass tables= (TableConfigs / EmbeddingBagConfigs / TableSpecs) or embedding_dim= so "
                             "the split knows each row's bytes")
        tables = [TableSpec(n, None, int(embedding_dim)) for n in traces]
    specs = [TableSpec.from_config(t, optimizer) for t in tables]
    missing = [s.name for s in specs if s.name not in traces]
    if missing:
        raise ValueError(f"no trace for table(s) {missing}; traces are for {sorted(traces)}")
    return specs


def _groups(groups, specs: list[TableSpec]) -> list[list[int]]:
    if groups is None:
        return [[i] for i in range(len(specs))]
    if groups == "collection":  # CachedEmbeddingBagCollection's grouping, in its order
        members: dict[tuple, list[int]] = {}
        for i, s in enumerate(specs):
            members.setdefault((s.embedding_dim, s.pooling, s.dtype), []).append(i)
        return list(members.values())
    index = {s.name: i for i, s in enumerate(specs)}
    out = [[index[n] if n in index else _unknown(n, index) for n in g] for g in groups]
    flat = [i for g in out for i in g]
    if sorted(flat) != list(range(len(specs))):
        raise ValueError(f"groups must name every table exactly once, got {groups}")
    return out


def _unknown(name, index):
    raise ValueError(f"groups name an unknown table {name!r}; tables are {sorted(index)}")


def _merge_curves(a: MissRatioCurve, b: MissRatioCurve) -> MissRatioCurve:
    sizes = np.concatenate([a.sizes, b.sizes])
    order = np.argsort(sizes, kind="stable")
    sizes, keep = np.unique(sizes[order], return_index=True)
    pick = order[keep]
    moved = np.concatenate([a.rows_moved, b.rows_moved])[pick]
    stderr = None if a.stderr is None else np.concatenate([a.stderr, b.stderr])[pick]
    return MissRatioCurve(a.policy, sizes, moved, a.num_batches, a.unique_lookups, a.lookups, a.distinct_ids,
                          a.sample_rate, stderr, a.method, dict(a.options))


def _floor(min_rows, trace: TableTrace, top: int) -> int:
    """The least cache rows a table's split may choose: one batch's distinct ids ("batch") or ``min_rows``."""
    if min_rows == "batch":
        return max(1, min(int(trace.unique_per_batch.max(initial=1)), top))
    if isinstance(min_rows, bool) or not isinstance(min_rows, (int, np.integer)) or min_rows < 1:
        raise ValueError(f"min_rows must be 'batch' or a positive int, got {min_rows!r}")
    return max(1, min(int(min_rows), top))


def _costs(specs, curves, top, floor, cost="device") -> list[TableCost]:
    out = []
    for i, (s, c) in enumerate(zip(specs, curves)):
        keep = (c.sizes >= floor[i]) & (c.sizes <= top[i])
        sizes = c.sizes[keep]
        if sizes.size == 0 or sizes[0] != floor[i]:
            sizes = np.concatenate([[floor[i]], sizes])
        moved = np.asarray(c.rows_per_batch_at(sizes)) * s.transfer_bytes
        row_cost = s.device_row_bytes if cost == "device" else s.host_row_bytes
        out.append(TableCost(s.name, sizes, moved, row_cost))
    return out


def plan(source, budget_bytes: int | str, tables=None, *, optimizer=None, policy: str = "lfu", horizon: int = 64,
         depth: int = 4, overlap: bool = True, compare: Sequence[str] = (), groups="collection", id_freq="auto",
         warmup_ratio: float = 0.7, host_budget_bytes: int | str | None = None, min_rows: int | str = "batch",
         embedding_dim: int | None = None,
         points: int = 24, refine: int = 6, error_bands: int = 4, batch_size: int | None = None,
         limit_batches: int | None = None, shuffle: bool = True, seed: int = 0, epoch: int = 0, ids=None,
         sample_rate: float = 1.0, max_unique: int | str | None = "auto", salt: int = 0) -> SizingPlan:
    """Cache rows per table for ``budget_bytes`` of device memory, from the id traces of ``source`` (see
    `read_traces`; a dict of `TableTrace` is used as is).

    ``tables``: TableConfigs / torchrec EmbeddingBagConfigs / TableSpecs (rows, dim, dtype, features; default:
    the data directory's, or ``embedding_dim`` for array traces); ``optimizer``: the `cachedemb.optim` spec the
    module trains with (its state moves with each row). ``policy``: the module's eviction policy (``"lfu"``, its
    default; ``"lookahead"`` under `cachedemb.prefetch` with its ``horizon``, ``depth`` and ``overlap`` (on by
    default, as in the pipeline); ``"lru"``; ``"opt"``, the floor); ``compare``: more policies whose curves are computed for the report. ``groups``: ``"collection"``
    (tables of one (dim, pooling, dtype) share a cache, as CachedEmbeddingBagCollection builds them), None (a
    cache per table) or lists of table names. ``id_freq``: {table: train counts} the module warm-starts from
    (``"auto"``: a data directory's, else none), preloading ``warmup_ratio`` of each cache.
    ``host_budget_bytes``: also size host caches in front of a file tier. ``min_rows``: the least rows a table's
    cache may get, ``"batch"`` (default) its largest batch's distinct ids (below that every batch overflows the
    cache: the module then serves rows from the host, which the simulators' streaming model predicts within ~25%
    only), or a number. ``points`` sizes per curve, ``refine`` more around each chosen size; sampling:
    ``sample_rate``, ``max_unique``, ``salt``, ``error_bands``.
    """
    budget_bytes = _check_budget(budget_bytes)  # before any trace is read
    ctx = _prepare(source, tables, optimizer=optimizer, policy=policy, horizon=horizon, depth=depth,
                   overlap=overlap, compare=compare, groups=groups, id_freq=id_freq, warmup_ratio=warmup_ratio,
                   host_budget_bytes=host_budget_bytes, min_rows=min_rows, embedding_dim=embedding_dim,
                   points=points, refine=refine, error_bands=error_bands, batch_size=batch_size,
                   limit_batches=limit_batches, shuffle=shuffle, seed=seed, epoch=epoch, ids=ids,
                   sample_rate=sample_rate, max_unique=max_unique, salt=salt)
    return _plan_at(ctx, budget_bytes, tuple(compare))


def _check_budget(budget_bytes) -> int:
    budget_bytes = parse_bytes(budget_bytes) if isinstance(budget_bytes, str) else budget_bytes
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive number of bytes (an int or e.g. '8GiB'), got "
                         f"{budget_bytes!r}")
    return int(budget_bytes)


@dataclass
class _Context:
    """What every budget's split shares: the specs, traces and curves (refined in place as budgets are split:
    a later split sees every point an earlier one measured), each table's size range, the warm starts."""

    specs: list[TableSpec]
    traces: dict[str, TableTrace]
    curves: list[MissRatioCurve]
    top: list[int]
    floors: list[int]
    warm: dict
    kw: dict
    policy: str
    groups: object
    min_rows: object
    refine: int
    host_budget_bytes: int | None
    warmup_ratio: float | None

    @property
    def least_bytes(self) -> int:
        """The smallest budget the split accepts: every table at its floor."""
        return sum(f * s.device_row_bytes for f, s in zip(self.floors, self.specs))

    @property
    def whole_bytes(self) -> int:
        """The budget at which every table's cache holds all its distinct ids (more changes nothing)."""
        return sum(t * s.device_row_bytes for t, s in zip(self.top, self.specs))


def _prepare(source, tables, *, optimizer, policy, horizon, depth, overlap, compare, groups, id_freq, warmup_ratio,
             host_budget_bytes, min_rows, embedding_dim, points, refine, error_bands, batch_size, limit_batches,
             shuffle, seed, epoch, ids, sample_rate, max_unique, salt) -> _Context:
    """Traces, specs and each table's curve under ``policy``: everything of `plan` but the split."""
    for p in (policy, *compare):
        if p not in POLICIES:
            raise ValueError(f"policy {p!r}: expected one of {POLICIES}")
    if isinstance(host_budget_bytes, str):
        host_budget_bytes = parse_bytes(host_budget_bytes)
    if isinstance(source, (str, Path)):
        source = readers.open_path(source)
    traces = read_traces(source, tables, batch_size=batch_size, limit_batches=limit_batches, shuffle=shuffle,
                         seed=seed, epoch=epoch, ids=ids, sample_rate=sample_rate, max_unique=max_unique, salt=salt)
    specs = _specs(tables, traces, source, optimizer, embedding_dim)
    if isinstance(id_freq, str):
        if id_freq != "auto":
            raise ValueError(f"id_freq must be 'auto', None or {{table: counts}}, got {id_freq!r}")
        id_freq = source.id_freq() if isinstance(source, readers.DataDir) else None
    warm = {}
    if id_freq is not None and warmup_ratio is not None:
        unknown = set(id_freq) - {s.name for s in specs}
        if unknown:
            raise ValueError(f"id_freq names unknown tables {sorted(unknown)}")
        warm = {name: WarmStart(np.asarray(c), warmup_ratio) for name, c in id_freq.items() if c is not None}
    kw = {"horizon": horizon, "depth": depth, "overlap": overlap, "error_bands": error_bands}
    curves, top, floors = [], [], []
    for s in specs:
        t, cap = traces[s.name], s.num_embeddings
        kept = t.kept_ids()
        distinct = kept.size if t.exact else int(round(kept.size / t.rate))
        if cap is not None and kept.size and int(kept.max()) >= cap:
            raise ValueError(f"table {s.name!r}: id {int(kept.max())} is outside its {cap} rows")
        sizes = default_sizes(distinct, points, cap)
        floor = _floor(min_rows, t, int(sizes[-1]))
        curves.append(miss_ratio_curve(t, policy, np.union1d(sizes, [floor]), num_rows=cap,
                                       warm_start=warm.get(s.name), **kw))
        top.append(int(sizes[-1]))
        floors.append(floor)
    return _Context(specs, traces, curves, top, floors, warm, kw, policy, groups, min_rows, refine,
                    host_budget_bytes, warmup_ratio)


def _plan_at(ctx: _Context, budget_bytes: int, compare: tuple[str, ...] = ()) -> SizingPlan:
    """The split of ``budget_bytes`` over ``ctx``'s curves (refining them around it), and its predictions."""
    specs, traces, curves, top, floors, warm, kw, policy = (ctx.specs, ctx.traces, ctx.curves, ctx.top, ctx.floors,
                                                            ctx.warm, ctx.kw, ctx.policy)
    try:
        split = split_budget(_costs(specs, curves, top, floors), int(budget_bytes))
    except ValueError as e:
        if "below the smallest caches" not in str(e) or ctx.min_rows != "batch":
            raise
        raise ValueError(f"{e}; min_rows='batch' keeps each cache at least one batch's distinct ids (smaller caches "
                         "stream every batch; the module serves those rows from the host): raise the budget or pass "
                         "min_rows=1") from None
    if ctx.refine:
        for i, s in enumerate(specs):
            c, chosen = curves[i], split.rows[s.name]
            k = int(np.searchsorted(c.sizes, chosen))
            lo, hi = c.sizes[max(k - 1, 0)], c.sizes[min(k + 1, c.sizes.size - 1)]
            extra = np.setdiff1d(np.unique(np.linspace(lo, hi, ctx.refine + 2).round().astype(np.int64)), c.sizes)
            extra = extra[extra > 0]
            if extra.size:
                more = miss_ratio_curve(traces[s.name], policy, extra, num_rows=s.num_embeddings,
                                        warm_start=warm.get(s.name), **kw)
                curves[i] = _merge_curves(c, more)
        split = split_budget(_costs(specs, curves, top, floors), int(budget_bytes))
    plans = [TablePlan(s, split.rows[s.name], {policy: curves[i]}, policy, group=-1) for i, s in enumerate(specs)]
    _add_compare(ctx, plans, compare)
    group_plans = []
    for g, members in enumerate(_groups(ctx.groups, specs)):
        for i in members:
            plans[i].group = g
        group_plans.append(_predict_group([plans[i] for i in members], [traces[specs[i].name] for i in members],
                                          warm, policy, kw))
    host_split = None
    if ctx.host_budget_bytes is not None:
        floor = [p.cache_rows for p in plans]
        host_split = split_budget(_costs(specs, curves, [max(a, b) for a, b in zip(top, floor)], floor, "host"),
                                  int(ctx.host_budget_bytes))
        for p in plans:
            p.host_rows = host_split.rows[p.name]
    options = dict(horizon=kw["horizon"], depth=kw["depth"], overlap=kw["overlap"]) if policy == "lookahead" else {}
    if warm:
        options["warmup_ratio"] = ctx.warmup_ratio
    return SizingPlan(plans, group_plans, int(budget_bytes), split, policy, options, ctx.host_budget_bytes,
                      host_split)


def _add_compare(ctx: _Context, plans, compare) -> None:
    """Each table's curve under the ``compare`` policies too, at its curve's sizes (for the report)."""
    for t in getattr(plans, "tables", plans):
        for p in compare:
            if p not in t.curves:
                t.curves[p] = miss_ratio_curve(ctx.traces[t.name], p, t.curve.sizes, num_rows=t.spec.num_embeddings,
                                               warm_start=ctx.warm.get(t.name), **ctx.kw)


def _predict_group(plans: list[TablePlan], traces: list[TableTrace], warm: dict, policy: str, kw) -> GroupPlan:
    """The shared cache of a group: rows summed, simulated on the tables' merged trace at that size."""
    names = tuple(p.name for p in plans)
    rows = sum(p.cache_rows for p in plans)
    if len(plans) == 1:
        p = plans[0]
        stderr = float(np.interp(rows, p.curve.sizes, p.curve.stderr)) if p.curve.stderr is not None else 0.0
        return GroupPlan(names, rows, p.miss_ratio, p.rows_per_batch, p.pcie_bytes_per_step, stderr)
    sizes = [p.spec.num_embeddings or int(t.kept_ids().max(initial=-1)) + 1 for p, t in zip(plans, traces)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    merged = merge(traces, starts)
    group_warm = None
    if any(p.name in warm for p in plans):
        counts = [warm[p.name].counts if p.name in warm else np.zeros(n, dtype=np.int64)
                  for p, n in zip(plans, sizes)]
        group_warm = WarmStart(np.concatenate([c[:n] if c.size >= n else np.pad(c, (0, n - c.size))
                                               for c, n in zip(counts, sizes)]), next(iter(warm.values())).ratio)
    rows = min(rows, int(sum(sizes)))
    curve = miss_ratio_curve(merged, policy, [0, rows], warm_start=group_warm, **kw)
    transfer = plans[0].spec.transfer_bytes  # a group's tables share dim, dtype and optimizer
    ratio = float(curve.miss_ratio[1])
    per_batch = ratio * curve.unique_per_batch
    stderr = float(curve.stderr[1]) if curve.stderr is not None else 0.0
    return GroupPlan(names, rows, ratio, per_batch, per_batch * transfer, stderr)


def parse_bytes(text) -> int:
    """``"8GiB"``, ``"512MB"``, ``"1.5 GiB"``, ``"1000000"`` -> bytes (binary and decimal units)."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        return int(text)
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a byte size; expected a number with an optional unit (B, KB, MB, GB, TB, "
                         "KiB, MiB, GiB, TiB), e.g. 8GiB")
    return int(value * units[unit])


__all__ = ["AUTO_MAX_UNIQUE", "COUNT_BYTES", "GroupPlan", "SLOT_METADATA_BYTES", "SizingPlan", "TablePlan",
           "TableSpec", "parse_bytes", "plan", "read_traces", "state_cols"]
