"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection interface over CachedEmbeddingBag.

Tables with the same (embedding_dim, pooling, dtype) share one CachedEmbeddingBag — one host table holding
their rows back to back (per-table row offsets) behind one device cache — so a model with 26 tables runs one
cached lookup per group, not per table. Each group's forward is a single call: the ids of all its lookups (plus
their table's row offset) concatenated lookup-major, one bag per (lookup, sample). A lookup is a (table,
feature) pair: a feature several tables look up is one lookup per table (output keys `feature@table`).

A table with `dynamic=DynamicIds(...)` (raw int64 ids, cachedemb.dynamic) is a group of its own, a
DynamicEmbeddingBag over its slab: its lookups' raw ids go in unshifted and the remap finds their rows.

With `storage=FileStorage(directory, host_cache_bytes)` (cachedemb.storage) every other table is a group of its
own, a FileBackedEmbeddingBag on `<directory>/<table name>.cemb`; the host cache bytes are split over the tables
in proportion to their rows x dim (at least 4 KiB each).

fx tracing, export, torch.compile and TorchScript: see `cachedemb.collection.capture`.
"""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from cachedemb.cache.exact_device import exact_device
from cachedemb.collection import cache_budget, capture
from cachedemb.cache.embedding_cache import pinned_empty
from cachedemb.collection.capture import NotScriptableError, fx_lookup, fx_lookup_live
from cachedemb.collection.inputs import CollectionInputs, is_torchrec, torchrec_type
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag, DynamicIds
from cachedemb.modules.cache_stats import sum_stats
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.modules.errors import InvalidWeightDtypeError, InvalidWeightShapeError
from cachedemb.modules.meta_init import default_device, probe_apply
from cachedemb.optim import SparseOptimizer
from cachedemb.cache.policy import Policy
from cachedemb.collection.table_config import DTYPES, TableConfig
from cachedemb.modules.meta_init import TableInit, iter_init_chunks
from cachedemb.storage.embedding_bag import FileBackedEmbeddingBag, FileStorage

# Under torch.fx.symbolic_trace each lookup is one node calling these (patched in this module's globals).
torch.fx.wrap("fx_lookup")
torch.fx.wrap("fx_lookup_live")


_STEP = "optimizer.step"
_META = torch.device("meta")
_MIN_TABLE_HOST_BYTES = 4 << 10  # a table on file gets at least this much of the host cache (a few rows)


class _GroupBag(CachedEmbeddingBag):
    """A group's CachedEmbeddingBag; its state is saved and loaded per table by the collection's table views."""

    _warn_as = "CachedEmbeddingBagCollection (a group of tables of one dim)"  # CacheTooSmallWarning's subject

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        return None


class _DynamicGroupBag(DynamicEmbeddingBag):
    """A dynamic table's DynamicEmbeddingBag; its state is saved and loaded by the table's view."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        return None


class _FileGroupBag(FileBackedEmbeddingBag):
    """A table on file; its state (a snapshot descriptor) is saved and loaded by the table's view."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        return None


class _TableRows(nn.Parameter):
    """`embedding_bags[table].weight`: a view of the table's rows in its group's host table (a Parameter, as
    torchrec's is, so code comparing or type-checking it against torchrec's keeps working). Tables of a group
    share one host table, so rebinding this tensor's storage (`.data = t`, `.set_(t)`, as code written for
    torchrec's Parameters does) cannot make t the table: the collection copies t's rows into the table instead,
    so the next forward and every later step use them. Other ops see a plain tensor; copies are plain tensors."""

    @staticmethod
    def of(rows: torch.Tensor, owner: "CachedEmbeddingBagCollection", index: int) -> "_TableRows":
        view = rows.as_subclass(_TableRows)
        view._owner, view._index = owner, index
        return view

    @property
    def data(self):
        return torch.Tensor.data.__get__(self).as_subclass(torch.Tensor)

    @data.setter
    def data(self, value):
        self._owner._adopt_table_rows(self._index, value)

    def set_(self, source=None, *args, **kwargs):
        if source is None or args or kwargs or not torch.is_tensor(source):
            raise TypeError("embedding_bags[table].weight.set_ takes one tensor (the table's new rows)")
        self._owner._adopt_table_rows(self._index, source)
        return self

    def __deepcopy__(self, memo):
        return torch.Tensor.clone(self.data)

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(self.data, protocol)

    def __repr__(self):
        return torch.Tensor.__repr__(self.data)


class _TableView(nn.Module):
    """`collection.embedding_bags[table]`: the table's rows inside its group. `weight` is the table's full host
    rows in id order, fetched at each access (a view of the group's `weight`: cached updates are written back
    first, and in-place writes through it are seen by the next forward). state_dict keys
    `weight` / `optimizer.<state>` / `optimizer.step` as torchrec's EmbeddingBagCollection (plus the state)."""

    def __init__(self, owner: "CachedEmbeddingBagCollection", index: int):
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: the owner holds this view
        self._index = index
        table = owner.tables[index]
        self.num_embeddings, self.embedding_dim, self.mode = table.num_embeddings, table.embedding_dim, table.pooling

    @property
    def weight(self) -> torch.Tensor:
        return self._owner._table_rows(self._index)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._owner._save_table(self._index, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self._owner._load_table(self._index, state_dict, prefix, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"


@dataclass(frozen=True)
class _Group:
    dim: int
    pooling: str
    dtype: torch.dtype
    tables: tuple[int, ...]  # indices into the collection's tables
    row_offsets: tuple[int, ...]  # first group row of each table
    rows: int
    lookups: tuple[int, ...]  # indices into the collection's lookups, in output order
    dynamic: DynamicIds | None = None  # a raw-id table, alone in its group
    stored: bool = False  # a table on file (storage=), alone in its group


@dataclass(frozen=True)
class _Lookup:
    """One (table, feature) pair: an output key of the collection."""

    table: int
    feature: str
    name: str  # `feature`, or `feature@table` when several tables look the feature up (torchrec's rule)


def _reload_after_load(module: "CachedEmbeddingBagCollection", incompatible_keys) -> None:
    module._finish_load()


class CachedEmbeddingBagCollection(CollectionInputs, nn.Module):
    """A drop-in `torchrec.modules.embedding_modules.EmbeddingBagCollection` whose tables live in host memory.

    `tables` are `TableConfig`s or torchrec `EmbeddingBagConfig`s (their pooling, data_type and init_fn are
    honoured). Tables are grouped by (embedding_dim, pooling, dtype); each group is one `CachedEmbeddingBag`
    with its own cache of `cache_rows` rows (default `cache_ratio` of the group's rows) and the fused
    `optimizer` (one of `cachedemb.optim`; None makes each group's `weight` a Parameter for a torch optimizer,
    see CachedEmbeddingBag). Tables are initialized as torchrec's EmbeddingBagCollection does, drawing the same
    random numbers (nn.EmbeddingBag's normal_ of every table, then each table's init_fn, on the CPU generator),
    so a model seeded the same way starts from the same values. `reset_parameters()` re-runs the init_fns.

    Like torchrec's collection: `embedding_bags[table].weight` is the table's full rows (here a view of its
    group's host table), state_dict keys are `embedding_bags.<table>.weight`, a feature looked up by several
    tables gives output keys `feature@table`, and input keys no table uses are ignored. With `device="meta"`
    (or under `with torch.device("meta")`) no host table or cache is allocated until `to_empty(device=...)` /
    `.to(device)`, which allocate them zeroed; then `reset_parameters()` initializes them.

    Input, every feature of every table present, each with the same batch size B:

    * a torchrec `KeyedJaggedTensor` (offsets include the end, per key then per sample) -> `KeyedTensor`
      with keys in torchrec's order (tables in order, each table's feature_names) and float32 values
      [B, sum(dims)]; keys no table uses are ignored;
    * a dict {feature: (values, offsets)} with offsets of B + 1 entries (offsets[0] == 0,
      offsets[-1] == len(values)); with `jagged="lengths"`, {feature: (values, lengths)} with B lengths; a
      torchrec JaggedTensor also works -> dict {key: pooled [B, dim]} (the KeyedTensor's keys);
    * a 2-D integer tensor [B, len(feature_names)], one id per (sample, feature), columns in `feature_names`
      order -> dict {key: pooled [B, dim]}.

    Cache sizes: `cache_rows` (rows per group cache), `cache_ratio` (of the group's rows), `cache_rows={table:
    rows}` (a group's cache holds its tables' rows summed), or `cache_rows="auto"` with `budget_bytes=` (device
    bytes for all caches: an int or "8GiB") and `sample=` (an iterable of input batches, as forward takes them):
    the budget is split over the tables from the sample's miss-ratio curves under `policy` (`cachedemb.sizing`;
    `sizing={...}` passes options such as `depth`/`horizon` for "lookahead"); `sizing_plan` then holds the
    plan: rows, predicted hit rates and PCIe bytes per step, per table and per group cache.

    Ids must be in [0, num_embeddings) of their table, unless `hash_ids=True`, which maps every id to
    `id % num_embeddings` (torch ops on the ids' device). `id_freq` (per-table access counts, a list aligned
    with `tables` or a dict by table name) seeds the cache's frequency policy and warm-up. `dynamic`
    ({table name: DynamicIds}, or `TableConfig(dynamic=...)`) makes those tables take raw int64 ids (any value;
    see cachedemb.dynamic); their state_dict entries are keyed by id (`embedding_bags.<table>.ids`, `.weight`, ...).

    Example::

        >>> tables = [TableConfig("t1", 10, 3, ["f1"]), TableConfig("t2", 10, 3, ["f2"])]
        >>> ebc = CachedEmbeddingBagCollection(tables, cache_rows=4, optimizer=cachedemb.optim.SGD(0.1))
        >>> out = ebc({"f1": (torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2, 3])),   # bags [0,1], [], [2]
        ...            "f2": (torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 5]))})
        >>> out["f1"].shape                                 # one group (dim 3, sum): rows 0-9 t1, 10-19 t2
        torch.Size([3, 3])
    """

    def __init__(self, tables: Sequence, is_weighted: bool = False, device=None, *, cache_ratio: float = 0.01,
                 cache_rows: int | str | Mapping[str, int] | None = None, optimizer: SparseOptimizer | None = None,
                 id_freq=None, warmup_ratio: float = 0.7, policy: str | Policy = "lfu", hash_ids: bool = False,
                 validate_inputs: bool = True, dynamic: Mapping[str, DynamicIds] | None = None,
                 count_in_eval: bool = False, budget_bytes: int | str | None = None, sample=None,
                 sizing: Mapping | None = None, storage: FileStorage | None = None):
        super().__init__()
        if storage is not None and not isinstance(storage, FileStorage):
            raise TypeError(f"storage must be a cachedemb.FileStorage (a directory for the tables' files), got "
                            f"{type(storage).__name__}")
        self.storage = storage
        self._configs = list(tables)
        self.tables: list[TableConfig] = self._check_tables(self._configs, dynamic)
        self.hash_ids, self.is_weighted_, self.validate_inputs = bool(hash_ids), bool(is_weighted), validate_inputs
        per_table = cache_rows == "auto" or isinstance(cache_rows, Mapping)
        self._bag_kwargs = dict(cache_ratio=cache_ratio, cache_rows=None if per_table else cache_rows,
                                optimizer=optimizer, warmup_ratio=warmup_ratio, policy=policy)
        self.count_in_eval = bool(count_in_eval)  # plain tables only: dynamic tables' eval forwards are read-only
        self._freqs = self._check_id_freq(id_freq)
        shared = Counter(f for t in self.tables for f in t.feature_names)
        self._lookups = [_Lookup(i, f, f"{f}@{t.name}" if shared[f] > 1 else f)
                         for i, t in enumerate(self.tables) for f in t.feature_names]
        self.embedding_names: list[str] = [lk.name for lk in self._lookups]
        self.feature_names: list[str] = list(dict.fromkeys(lk.feature for lk in self._lookups))
        self._feature_index = {f: i for i, f in enumerate(self.feature_names)}
        self._dims = [self.tables[lk.table].embedding_dim for lk in self._lookups]
        self._plan_groups()
        # {table: rows} (cache_rows={...} or "auto"): a group's cache holds its tables' rows summed
        self._rows_by_table, self.sizing_plan = cache_budget.table_cache_rows(self, cache_rows, budget_bytes,
                                                                              sample, sizing)
        self.bags = nn.ModuleList()
        self.embedding_bags = nn.ModuleDict({t.name: _TableView(self, i) for i, t in enumerate(self.tables)})
        self._pending_load: dict[int, int | None] = {}  # group -> loaded optimizer step (None: weights only)
        self.register_load_state_dict_post_hook(_reload_after_load)
        self._dense_index: dict = {}
        self._handle = capture.register(self)
        self._device = self._resolve_device(device)
        if self._device.type != "meta":
            self._materialize(self._device, initialize=True)

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def _check_tables(configs, dynamic) -> list[TableConfig]:
        dynamic = dict(dynamic or {})
        names = [getattr(c, "name", None) for c in configs]
        unknown = sorted(set(dynamic) - set(names))
        if unknown:
            raise ValueError(f"dynamic= names unknown tables {unknown}; tables are {names}")
        tables = [TableConfig.from_config(c, dynamic.get(getattr(c, "name", None))) for c in configs]
        seen = set()
        for t in tables:
            if t.name in seen:
                raise ValueError(f"duplicated table name {t.name!r}")
            seen.add(t.name)
        return tables

    def _check_id_freq(self, id_freq):
        if id_freq is None:
            return None
        if isinstance(id_freq, Mapping):
            unknown = set(id_freq) - {t.name for t in self.tables}
            if unknown:
                raise ValueError(f"id_freq has unknown table names {sorted(unknown)}; tables are "
                                 f"{[t.name for t in self.tables]}")
            items = [id_freq.get(t.name) for t in self.tables]
        else:
            items = list(id_freq)
            if len(items) != len(self.tables):
                raise ValueError(f"id_freq must have one entry per table ({len(self.tables)}), got {len(items)}")
        out = []
        for t, freq in zip(self.tables, items):
            if t.dynamic is not None:
                if freq is not None:
                    raise ValueError(f"id_freq of table {t.name!r}: a dynamic-id table counts its ids itself "
                                     "(DynamicIds.min_count); pass None for it")
                out.append(None)
                continue
            if freq is None:
                out.append(torch.zeros(t.num_embeddings, dtype=torch.int64, device="cpu"))
                continue
            freq = torch.as_tensor(freq)
            if freq.shape != (t.num_embeddings,):
                raise ValueError(f"id_freq of table {t.name!r} must have shape ({t.num_embeddings},), "
                                 f"got {tuple(freq.shape)}")
            out.append(freq.to(torch.int64))
        return out

    def _plan_groups(self) -> None:
        members: dict[tuple, list[int]] = {}
        for i, t in enumerate(self.tables):
            alone = t.dynamic is not None or self.storage is not None
            key = (t.embedding_dim, t.pooling, t.dtype) + ((i,) if alone else ())
            members.setdefault(key, []).append(i)
        self._groups: list[_Group] = []
        self._table_group: dict[int, tuple[int, int]] = {}  # table -> (group, row offset)
        self._lookup_slot: list[tuple[int, int]] = [(0, 0)] * len(self._lookups)  # lookup -> (group, position)
        for g, ((dim, pooling, dtype, *_), tables) in enumerate(members.items()):
            offsets = [0]
            for i in tables:
                self._table_group[i] = (g, offsets[-1])
                offsets.append(offsets[-1] + self.tables[i].num_embeddings)
            lookups = tuple(k for k, lk in enumerate(self._lookups) if lk.table in tables)
            for j, k in enumerate(lookups):
                self._lookup_slot[k] = (g, j)
            dynamic = self.tables[tables[0]].dynamic
            self._groups.append(_Group(dim, pooling, dtype, tuple(tables), tuple(offsets[:-1]), offsets[-1],
                                       lookups, dynamic, self.storage is not None and dynamic is None))

    def _group_bag_kwargs(self, group: _Group) -> dict:
        """The group module's cache and optimizer arguments: per-table rows summed when they were given."""
        if self._rows_by_table is None:
            return self._bag_kwargs
        rows = sum(self._rows_by_table[self.tables[i].name] for i in group.tables)
        return {**self._bag_kwargs, "cache_rows": max(1, min(rows, group.rows))}

    @staticmethod
    def _resolve_device(device) -> torch.device:
        """As torchrec: an explicit device, else the default device (`with torch.device(...)`); the plain CPU
        default means CUDA when there is one (where the cache belongs)."""
        if device is not None:
            return exact_device(device)
        default = default_device()
        if default.type != "cpu":
            return exact_device(default)
        return exact_device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def _materialize(self, device: torch.device, initialize: bool) -> None:
        """Allocate the host tables and caches on `device`: initialized as torchrec, or zeroed (to_empty)."""
        with torch.device("cpu"):  # host tables and module scalars, whatever default device the caller set
            # Dynamic tables have no host table here (slab rows are created per id on admission), tables on file
            # none either (their rows stream into the file).
            hosts = [pinned_empty((g.rows, g.dim), g.dtype) if g.dynamic is None and not g.stored else None
                     for g in self._groups]
            fixed = [i for i, t in enumerate(self.tables) if t.dynamic is None]
            stored = {}
            if initialize:
                for i in fixed:  # nn.EmbeddingBag's own init, as torchrec's EBC draws it
                    g, lo = self._table_group[i]
                    if self._groups[g].stored:  # drawn and dropped: the init_fn overwrites it
                        for _ in iter_init_chunks(TableInit.normal(), self.tables[i].num_embeddings *
                                                  self.tables[i].embedding_dim, self.tables[i].dtype):
                            pass
                    else:
                        hosts[g][lo:lo + self.tables[i].num_embeddings].normal_()
                for i in fixed:
                    g, lo = self._table_group[i]
                    if self._groups[g].stored:  # the init_fn's draws stream into the file, in table order
                        stored[g] = self._file_bag(g, device)
                    else:
                        self.tables[i].initialize(hosts[g][lo:lo + self.tables[i].num_embeddings])
            else:
                for host in hosts:
                    if host is not None:
                        host.zero_()
            bags = nn.ModuleList()
            for g, (group, host) in enumerate(zip(self._groups, hosts)):
                if group.stored:
                    bags.append(stored[g] if g in stored else self._file_bag(g, device))
                    continue
                if group.dynamic is not None:
                    bags.append(_DynamicGroupBag(None, group.dim, mode=group.pooling, include_last_offset=True,
                                                    dtype=group.dtype, device=device, dynamic=group.dynamic,
                                                    validate_inputs=False, **self._group_bag_kwargs(group)))
                    continue
                freq = torch.cat([self._freqs[i] for i in group.tables]) if self._freqs is not None else None
                bag = _GroupBag(group.rows, group.dim, mode=group.pooling, include_last_offset=True, _weight=host,
                                dtype=group.dtype, device=device, id_freq=freq, validate_inputs=False,
                                count_in_eval=self.count_in_eval, **self._group_bag_kwargs(group))
                bag.cache.set_tables(list(group.row_offsets))
                bags.append(bag)
        self.bags = bags
        self._dense_index = {}

    def _file_bag(self, g: int, device) -> FileBackedEmbeddingBag:
        """Group g's table on file: `<storage dir>/<table>.cemb` (created with the table's init_fn, or opened),
        with its share of the host cache bytes."""
        group = self._groups[g]
        (i,) = group.tables
        storage, init = self.table_storage(i), self.tables[i].table_init()
        freq = self._freqs[i] if self._freqs is not None and bool(self._freqs[i].any()) else None
        path_exists = storage.path.exists()
        return _FileGroupBag(group.rows, group.dim, mode=group.pooling, include_last_offset=True, dtype=group.dtype,
                             device=device, validate_inputs=False, count_in_eval=self.count_in_eval,
                             storage=storage, _init=init, id_freq=None if path_exists else freq,
                             **self._group_bag_kwargs(self._groups[g]))

    def table_storage(self, i: int) -> FileStorage:
        """Table i's file (`<storage dir>/<table>.cemb`) and its share of the host cache bytes (in proportion to
        rows x dim, at least 4 KiB); refuses an init_fn that cannot be streamed into a file."""
        table = self.tables[i]
        directory = Path(self.storage.path)
        if not directory.is_dir():
            raise FileNotFoundError(f"storage directory {str(directory)!r} of the collection's table files does "
                                    "not exist; create it first")
        weight = [t.num_embeddings * t.embedding_dim for t in self.tables if t.dynamic is None]
        share = max(_MIN_TABLE_HOST_BYTES,
                    self.storage.host_cache_bytes * table.num_embeddings * table.embedding_dim // sum(weight))
        if not table.table_init().elementwise:
            raise ValueError(f"table {table.name!r} on file: its init_fn cannot be streamed into the file (it must "
                             "draw element by element, as torchrec's default uniform_ does); drop init_fn, or "
                             "write the rows with CachedEmbeddingBag.from_pretrained(rows, storage=...)")
        return replace(self.storage, path=directory / f"{table.name}.cemb", host_cache_bytes=share)

    def close(self) -> None:
        """Commit and close the tables' files (storage=); nothing for tables in memory."""
        for bag in self.bags:
            if isinstance(bag, FileBackedEmbeddingBag):
                bag.close()

    def _apply(self, fn, recurse=True):
        """`.to(device)` / `to_empty(device=...)`: moves the caches (the host tables stay on the host); from
        meta, allocates the tables (zeroed: `reset_parameters()` initializes them); to meta, drops them."""
        probe = self._probe(fn, torch.float32)
        if not self.bags:  # dtype conversions (.half(), .to(dtype)) apply to the tables still to be allocated
            self.tables = [replace(t, dtype=self._probe(fn, t.dtype).dtype) for t in self.tables]
            self._plan_groups()
        if self.bags:
            self.adopt_rebound_tables()
        if probe.device.type == "meta":
            self.bags = nn.ModuleList()
        elif not self.bags and self.tables:
            self._materialize(probe.device, initialize=False)
        else:
            super()._apply(fn, recurse)  # each group moves its cache (and converts its table's dtype)
            for i, t in enumerate(self.tables):
                self.tables[i] = replace(t, dtype=self.bags[self._table_group[i][0]].cache.dtype)
        self._device = probe.device
        self._dense_index = {}
        return self

    def _probe(self, fn, dtype: torch.dtype) -> torch.Tensor:
        """What `fn` (of `_apply`) makes of a tensor of this dtype on the collection's device."""
        return probe_apply(fn, dtype, self.device)

    # ----------------------------------------------------------------- torchrec interface
    def embedding_bag_configs(self) -> list:
        """The table configs as given (torchrec EmbeddingBagConfigs or TableConfigs)."""
        return self._configs

    def is_weighted(self) -> bool:
        return self.is_weighted_

    @property
    def device(self) -> torch.device:
        """The device of the caches (meta before materialization); the host tables live in host memory."""
        return self.bags[0].cache.device if self.bags else self._device

    def reset_parameters(self) -> None:
        """Re-initialize every table with its init_fn, as torchrec's EmbeddingBagCollection (nothing on meta)."""
        if not self.bags:
            return
        self.adopt_rebound_tables()
        for i, t in enumerate(self.tables):
            if self._groups[self._table_group[i][0]].stored:
                raise ValueError(f"table {t.name!r} is on file: reset_parameters() would rewrite the whole file; "
                                 "start a new file (a new storage directory) for fresh tables")
            if t.dynamic is None:  # a dynamic table's rows are initial_rows(seed, id), made on admission
                t.initialize(self._table_rows(i))

    def __prepare_scriptable__(self):
        raise NotScriptableError("torch.jit.script " + capture.SCRIPT_MESSAGE)

    def to_embedding_bag_collection(self, device=None):
        """A torchrec EmbeddingBagCollection with a copy of the tables (for TorchScript, serving or a peer
        comparison); needs every table to fit where it goes. torchrec keeps BF16 tables as float16."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.types import DataType

        dynamic = [t.name for t in self.tables if t.dynamic is not None]
        if dynamic:
            raise ValueError(f"tables {dynamic} have dynamic (raw int64) ids, which a torchrec "
                             "EmbeddingBagCollection cannot look up: use collection.bags[...].export_keyed() "
                             "for those tables")
        names = {dtype: name for name, dtype in DTYPES.items()}
        configs = [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                      feature_names=list(t.feature_names), pooling=PoolingType[t.pooling.upper()],
                                      data_type=DataType[names.get(t.dtype, "FP32")]) for t in self.tables]
        device = torch.device(device or "cpu")
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            ebc = EmbeddingBagCollection(configs, is_weighted=self.is_weighted_, device=device)
        if self.bags:
            self.adopt_rebound_tables()
            with torch.no_grad():
                for i, t in enumerate(self.tables):
                    bag = self.bags[self._table_group[i][0]]
                    if isinstance(bag, FileBackedEmbeddingBag):  # streamed from the file, chunk by chunk
                        for start, rows, _, _ in bag.iter_rows():
                            ebc.embedding_bags[t.name].weight[start:start + rows.shape[0]].copy_(rows)
                    else:
                        ebc.embedding_bags[t.name].weight.copy_(self._host_rows(i))
        return ebc

    # ----------------------------------------------------------------- forward
    def forward(self, features, jagged: str = "offsets"):
        if isinstance(features, torch.fx.Proxy):
            return self._traced_forward(features)
        if torch.jit.is_tracing():
            raise NotScriptableError("torch.jit.trace " + capture.SCRIPT_MESSAGE)
        if capture.is_exporting():
            return self._exported_forward(features)
        if torch.compiler.is_compiling():
            return capture.eager_outside_dynamo(self, features, jagged)
        return self._eager_forward(features, jagged)

    def _eager_forward(self, features, jagged: str = "offsets"):
        is_kjt = is_torchrec(features, "KeyedJaggedTensor")
        if not self.bags:
            return self._unmaterialized_output(features, jagged, is_kjt)
        self.adopt_rebound_tables()
        pooled = self._pool(*self._group_inputs(features, jagged))
        if is_kjt:
            return self._keyed_tensor(self._concat(pooled))
        return {lk.name: pooled[g][j] for lk, (g, j) in zip(self._lookups, self._lookup_slot)}

    def _pool(self, batch: int, inputs: list) -> list[torch.Tensor]:
        """Each group's pooled float32 [lookups, B, dim]."""
        return [bag(ids, offsets, psw).view(len(group.lookups), batch, group.dim).float()
                for bag, group, (ids, offsets, psw) in zip(self.bags, self._groups, inputs)]

    def _concat(self, pooled: list) -> torch.Tensor:
        """[B, sum(dims)] in output order."""
        return torch.cat([pooled[g][j] for g, j in self._lookup_slot], dim=1)

    def _keyed_tensor(self, values: torch.Tensor):
        return torchrec_type("KeyedTensor")(keys=list(self.embedding_names), length_per_key=list(self._dims),
                                             values=values)

    def _unmaterialized_output(self, features, jagged: str, is_kjt: bool):
        """Meta (or table-less) collections: outputs of the right shapes and no lookups."""
        if is_kjt:
            batch, device = features.stride(), features.values().device
        elif torch.is_tensor(features):
            batch, device = features.shape[0], features.device
        else:
            self._check_keys(features.keys())
            first = next(iter(features.values()), None)
            if first is None:
                batch, device = 0, self.device
            elif is_torchrec(first, "JaggedTensor"):
                batch, device = first.offsets().numel() - 1, first.values().device
            else:
                batch = first[1].numel() - (0 if jagged == "lengths" else 1)
                device = first[0].device
        device = _META if self._device.type == "meta" else device
        values = torch.zeros(batch, sum(self._dims), device=device)
        if is_kjt:
            return self._keyed_tensor(values)
        return dict(zip(self.embedding_names, values.split(self._dims, dim=1)))

    def _traced_forward(self, features):
        """Under torch.fx.symbolic_trace: one opaque call for the lookup, then the KeyedTensor."""
        if torchrec_type("KeyedTensor") is None:
            raise TypeError("torch.fx tracing of CachedEmbeddingBagCollection takes a torchrec KeyedJaggedTensor "
                            "input (import torchrec); other input forms are not traceable")
        if getattr(getattr(features, "tracer", None), "root", None) is self:  # the collection is the traced root
            return self._keyed_tensor(fx_lookup_live(self._handle, features))
        return self._keyed_tensor(fx_lookup(self, features))

    def _exported_forward(self, features):
        """Under torch.export: the lookup as the custom op cachedemb::collection_lookup (the live collection)."""
        if not is_torchrec(features, "KeyedJaggedTensor"):
            raise TypeError("torch.export of CachedEmbeddingBagCollection takes a torchrec KeyedJaggedTensor input, "
                            f"got {type(features).__name__}")
        weights = features.weights_or_none() if self.is_weighted_ else None
        values = torch.ops.cachedemb.collection_lookup(self._handle, list(features.keys()), features.values(),
                                                       features.lengths(), weights)
        return self._keyed_tensor(values)

    def __setstate__(self, state):
        """Copies (deepcopy, pickle) get their own handle for captured graphs."""
        super().__setstate__(state)
        self._handle = capture.register(self)

    def _lookup_jagged(self, keys: list, values: torch.Tensor, lengths: torch.Tensor, weights) -> torch.Tensor:
        """The custom op's body: a KeyedJaggedTensor's parts -> values [B, sum(dims)] (reads the per-key sizes
        on the host)."""
        batch = lengths.numel() // max(len(keys), 1)
        per_key = lengths.view(len(keys), batch).sum(1).tolist() if keys else []
        starts = [0, *itertools.accumulate(per_key)]
        per_feature = {}
        for i, key in enumerate(keys):
            if key in self._feature_index:
                lens = lengths[i * batch:(i + 1) * batch]
                offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
                w = weights[starts[i]:starts[i + 1]] if weights is not None else None
                per_feature[key] = (values[starts[i]:starts[i + 1]], offsets, w)
        self._check_keys(per_feature.keys())
        if not self.bags:
            return torch.zeros(batch, sum(self._dims), device=values.device)
        return self._concat(self._pool(*self._jagged_inputs(per_feature)))

    def prefetch_targets(self, features, jagged: str = "offsets") -> list:
        """(cache, ids in its row space) per group for `features` (any forward input form): the protocol of
        `cachedemb.prefetch`, which admits a window's rows ahead of the forwards."""
        if not self.bags:
            return []
        self.adopt_rebound_tables()
        _, inputs = self._group_inputs(features, jagged)
        targets = []
        for bag, (ids, _, _) in zip(self.bags, inputs):
            wraps = isinstance(bag, (DynamicEmbeddingBag, FileBackedEmbeddingBag))  # a layer in front of the cache
            targets.extend(bag.prefetch_targets(ids) if wraps else [(bag.cache, ids)])
        return targets

    # ----------------------------------------------------------------- cache and tables
    def cache_stats(self) -> dict:
        """CachedEmbeddingBag.cache_stats summed over the groups (nested `seconds`, and `host_cache` / `file` of
        tables on file, too), `hit_rate` from the sums; a host sync on CUDA."""
        total = sum_stats([bag.cache_stats() for bag in self.bags])
        total.setdefault("seconds", {})  # a collection without groups still answers with its (empty) timings
        return total

    def reset_cache_stats(self) -> None:
        for bag in self.bags:
            bag.reset_cache_stats()

    def flush(self) -> None:
        """Write every dirty cached row (and optimizer state) back to the host tables."""
        self.adopt_rebound_tables()
        for bag in self.bags:
            bag.flush()

    def table_weight(self, name: str) -> torch.Tensor:
        """The full table `name` (as `embedding_bags[name].weight`)."""
        if name not in self.embedding_bags:
            raise ValueError(f"unknown table {name!r}; tables are {[t.name for t in self.tables]}")
        return self.embedding_bags[name].weight

    def _table_rows(self, i: int) -> torch.Tensor:
        """Table i's rows as a view of its group's `weight` (fetched now: cached updates written back, and the
        next forward re-reads the cache), or a meta tensor before materialization."""
        t = self.tables[i]
        if self._groups[self._table_group[i][0]].stored:
            raise ValueError(f"table {t.name!r} is on file ({str(self.storage.path)!r}): it has no weight in "
                             "memory; read it with collection.bags[...].iter_rows() or to_embedding_bag_collection()")
        if t.dynamic is not None:
            raise ValueError(f"table {t.name!r} has dynamic (raw int64) ids: it has no dense weight; read it with "
                             f"state_dict() (keyed by id) or collection.bags[{self._table_group[i][0]}]"
                             ".export_keyed()")
        if not self.bags:
            return torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype, device=_META)
        self.adopt_rebound_tables()
        g, lo = self._table_group[i]
        return _TableRows.of(self.bags[g].weight[lo:lo + t.num_embeddings], self, i)

    def adopt_rebound_tables(self) -> None:
        """Adopt a group's weight rebound behind its back (`p.data = t` over `parameters()`): see
        CachedEmbeddingBag.adopt_rebound_table. O(groups), no device sync."""
        for bag in self.bags:
            if isinstance(bag, CachedEmbeddingBag):
                bag.adopt_rebound_table()

    def _adopt_table_rows(self, i: int, value) -> None:
        """`embedding_bags[table].weight.data = value` (or `.set_(value)`): value's rows become the table's,
        copied into its rows of the group's host table (tables share it) after the group's pending rows are
        written back; checked first, so nothing changes when it cannot be adopted."""
        t = self.tables[i]
        g, lo = self._table_group[i]
        bag = self.bags[g]
        expected = (t.num_embeddings, t.embedding_dim)
        if not torch.is_tensor(value):
            raise TypeError(f"embedding_bags[{t.name!r}].weight.data must be set to a tensor, got "
                            f"{type(value).__name__}")
        if tuple(value.shape) != expected:
            raise InvalidWeightShapeError(f"embedding_bags[{t.name!r}].weight must have shape {expected}, got "
                                          f"{tuple(value.shape)}")
        if value.dtype != bag.cache.dtype:
            raise InvalidWeightDtypeError(
                f"embedding_bags[{t.name!r}].weight is {bag.cache.dtype} (its group's host table), got a "
                f"{value.dtype} tensor: convert it, or the collection with .to(dtype)")
        if value.device.type == "meta":
            raise InvalidWeightShapeError(f"embedding_bags[{t.name!r}].weight cannot take a meta tensor (no data)")
        self.adopt_rebound_tables()
        bag.flush()
        bag.cache.host_weight[lo:lo + t.num_embeddings].copy_(value.detach())
        bag.cache.reload()

    def _host_rows(self, i: int) -> torch.Tensor:
        """Table i's rows in the host table after a flush, without handing the group's weight out."""
        g, lo = self._table_group[i]
        self.bags[g].flush()
        return self.bags[g].cache.host_weight[lo:lo + self.tables[i].num_embeddings]

    # ----------------------------------------------------------------- state dict (torchrec EBC keys)
    def _save_table(self, i: int, destination, prefix: str) -> None:
        """`{prefix}weight` (as torchrec's EBC) and, with a fused optimizer, `{prefix}optimizer.{state}` and
        `{prefix}optimizer.step`. Values are views of host tables. A dynamic table saves its module's keys (ids,
        weight, optimizer state, counts: DynamicEmbeddingBag)."""
        if self.tables[i].dynamic is not None:
            if self.bags:
                DynamicEmbeddingBag._save_to_state_dict(self.bags[self._table_group[i][0]], destination, prefix,
                                                        False)
            return
        if self._groups[self._table_group[i][0]].stored:  # a snapshot descriptor (see cachedemb.storage)
            if self.bags:
                FileBackedEmbeddingBag._save_to_state_dict(self.bags[self._table_group[i][0]], destination,
                                                           prefix, False)
            return
        if not self.bags:
            destination[prefix + "weight"] = self._table_rows(i)
            return
        self.adopt_rebound_tables()
        g, lo = self._table_group[i]
        bag, hi = self.bags[g], lo + self.tables[i].num_embeddings
        destination[prefix + "weight"] = self._host_rows(i)
        if bag.optimizer is not None:
            for name, state in bag.cache.host_states.items():
                destination[prefix + f"optimizer.{name}"] = state[lo:hi]
            destination[prefix + _STEP] = torch.tensor(bag.optimizer_step, dtype=torch.int64, device="cpu")

    def _load_table(self, i: int, state_dict, prefix: str, missing_keys, unexpected_keys, error_msgs) -> None:
        t = self.tables[i]
        if t.dynamic is not None:
            if self.bags:
                DynamicEmbeddingBag._load_from_state_dict(self.bags[self._table_group[i][0]], state_dict, prefix,
                                                          {}, True, missing_keys, unexpected_keys, error_msgs)
            return
        if self._groups[self._table_group[i][0]].stored:
            if self.bags:
                FileBackedEmbeddingBag._load_from_state_dict(self.bags[self._table_group[i][0]], state_dict,
                                                             prefix, {}, True, missing_keys, unexpected_keys,
                                                             error_msgs)
            return
        if self.bags:
            self.adopt_rebound_tables()
        known = {prefix + "weight"}
        writes = []  # (key, value, host tensor whose rows [lo, lo + num_embeddings) it fills)
        if prefix + "weight" not in state_dict:
            missing_keys.append(prefix + "weight")
        g, lo = self._table_group[i]
        bag = self.bags[g] if self.bags else None
        if prefix + "weight" in state_dict and bag is not None:
            writes.append((prefix + "weight", state_dict[prefix + "weight"], bag.cache.host_weight))
        elif prefix + "weight" in state_dict:
            writes.append((prefix + "weight", state_dict[prefix + "weight"], self._table_rows(i)))
        if bag is not None and bag.optimizer is not None:
            for name, state in bag.cache.host_states.items():
                key = prefix + f"optimizer.{name}"
                known.add(key)
                if key in state_dict:
                    writes.append((key, state_dict[key], state))
            known.add(prefix + _STEP)
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known)
        bad = False
        for key, value, host in writes:
            expected = (t.num_embeddings, host.shape[1])
            if tuple(value.shape) != expected:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                  f"the shape in current model is {expected}")
                bad = True
        if bad or bag is None:
            return
        bag.flush()
        with torch.no_grad():
            for _, value, host in writes:
                host[lo:lo + t.num_embeddings].copy_(value)
        step = state_dict.get(prefix + _STEP) if bag.optimizer is not None else None
        previous = self._pending_load.get(g)
        if step is not None:
            self._pending_load[g] = max(int(step), previous or 0)
        else:
            self._pending_load.setdefault(g, None)

    def _finish_load(self) -> None:
        """After load_state_dict: the caches re-read the written host rows (and state); optimizer steps set."""
        for g, step in self._pending_load.items():
            if step is not None:
                self.bags[g].optimizer_step = step
            self.bags[g].cache.reload()
        self._pending_load = {}

    def extra_repr(self) -> str:
        groups = ", ".join(f"(dim={g.dim}, {g.pooling}, {str(g.dtype).replace('torch.', '')}: "
                           f"{[self.tables[i].name for i in g.tables]})" for g in self._groups)
        return f"tables={len(self.tables)}, groups=[{groups}], device={self.device}, hash_ids={self.hash_ids}"


__all__ = ["TableConfig", "CachedEmbeddingBagCollection", "NotScriptableError"]
