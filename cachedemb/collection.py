"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection interface over CachedEmbeddingBag.

Tables with the same (embedding_dim, pooling, dtype) share one CachedEmbeddingBag — one host table holding
their rows back to back (per-table row offsets) behind one device cache — so a model with 26 tables runs one
cached lookup per group, not per table. Each group's forward is a single call: the ids of all its lookups (plus
their table's row offset) concatenated lookup-major, one bag per (lookup, sample).

Graph capture, where the cache (Python-side state: admission, eviction, write-back) must stay one opaque step:

* `torch.fx.symbolic_trace`: the lookup is one wrapped call (`torch.fx.wrap`) taking the collection (a
  get_attr node) and the KeyedJaggedTensor; the GraphModule runs the same cache.
* `torch.export.export(..., strict=False)`: the lookup is the custom op `cachedemb::collection_lookup`, which
  names the live collection by a handle: the exported program runs in the process holding the collection,
  for inference (no autograd through the op).
* `torch.compile`: the lookup runs eagerly (a graph break); training works as without compile.
* `torch.jit.script`: refused with an explanation (`to_embedding_bag_collection()` gives a scriptable copy).
"""
from __future__ import annotations

import itertools
import math
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from cachedemb.cache import pinned_empty
from cachedemb.embedding_bag import CachedEmbeddingBag
from cachedemb.optim import SparseOptimizer
from cachedemb.policy import Policy
from cachedemb.sync_mode import counts_on_host


def _torchrec_type(name: str):
    """A torchrec sparse type, only if torchrec is already imported: importing it costs seconds, and an input
    can only be a KeyedJaggedTensor / JaggedTensor if the caller imported torchrec to build it."""
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    return getattr(module, name, None) if module is not None else None


def _is_torchrec(obj, name: str) -> bool:
    cls = _torchrec_type(name)
    return cls is not None and isinstance(obj, cls)


_POOLINGS = ("sum", "mean")
_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
# An unchecked id outside its table becomes this (still negative after the table's row offset is added), which
# the group's module turns into a padding lookup and counts as invalid.
_OUT_OF_GROUP = -(1 << 62)
_STEP = "optimizer.step"
_META = torch.device("meta")


class NotScriptableError(RuntimeError):
    """torch.jit.script of a module holding a CachedEmbeddingBagCollection."""


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_embeddings` rows of `embedding_dim`, looked up by each of `feature_names`
    (none: one feature named as the table, as torchrec does), pooled by `pooling`, stored as `dtype`
    (float32, float16 or bfloat16), initialized by `init_fn(rows)` (default: uniform in
    +-sqrt(1 / num_embeddings), torchrec's default)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    pooling: str = "sum"
    dtype: torch.dtype = torch.float32
    init_fn: Callable[[torch.Tensor], object] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"TableConfig.name must be a non-empty string without '.', got {self.name!r}")
        for field in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TableConfig {self.name!r}: {field} must be a positive int, got {value!r}")
        if isinstance(self.feature_names, str):
            raise ValueError(f"TableConfig {self.name!r}: feature_names must be a list of names, got the string "
                             f"{self.feature_names!r}; write [{self.feature_names!r}]")
        names = tuple(self.feature_names) or (self.name,)
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"TableConfig {self.name!r}: feature_names must be non-empty strings, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"TableConfig {self.name!r}: duplicated feature names in {names!r}")
        object.__setattr__(self, "feature_names", names)
        if self.pooling not in _POOLINGS:
            raise ValueError(f"TableConfig {self.name!r}: pooling must be one of {_POOLINGS}, got {self.pooling!r}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"TableConfig {self.name!r}: dtype must be float32, float16 or bfloat16, "
                             f"got {self.dtype}")
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"TableConfig {self.name!r}: init_fn must be callable, got {self.init_fn!r}")

    @classmethod
    def from_config(cls, config) -> "TableConfig":
        """A TableConfig from a torchrec `EmbeddingBagConfig` (duck-typed: torchrec is not imported). Empty
        `feature_names` become [name] in `config` itself, as torchrec's EmbeddingBagCollection does."""
        if isinstance(config, cls):
            return config
        missing = [a for a in ("name", "num_embeddings", "embedding_dim", "feature_names")
                   if not hasattr(config, a)]
        if missing:
            raise TypeError(f"tables must be TableConfig or torchrec EmbeddingBagConfig, got "
                            f"{type(config).__name__} without {missing}")
        pooling = getattr(config, "pooling", "sum")
        pooling = str(getattr(pooling, "value", pooling)).lower()  # torchrec PoolingType.SUM -> "sum"
        data_type = getattr(config, "data_type", None)
        dtype = torch.float32
        if data_type is not None:
            key = str(getattr(data_type, "name", data_type)).upper()
            if key not in _DTYPES:
                raise ValueError(f"table {config.name!r}: data_type {key} is not supported; use FP32, FP16 or "
                                 "BF16")
            dtype = _DTYPES[key]
        if not config.feature_names:
            config.feature_names = [config.name]
        return cls(config.name, config.num_embeddings, config.embedding_dim, tuple(config.feature_names), pooling,
                   dtype, getattr(config, "init_fn", None))

    def initialize(self, rows: torch.Tensor) -> None:
        """Fill this table's full rows in place with `init_fn` (torchrec's default without one)."""
        bound = math.sqrt(1.0 / self.num_embeddings)
        init = self.init_fn or partial(nn.init.uniform_, a=-bound, b=bound)
        with torch.no_grad():
            init(rows)


class _GroupBag(CachedEmbeddingBag):
    """A group's CachedEmbeddingBag; its state is saved and loaded per table by the collection's table views."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        return None


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


@dataclass(frozen=True)
class _Lookup:
    """One (table, feature) pair: an output key of the collection."""

    table: int
    feature: str
    name: str  # `feature`, or `feature@table` when several tables look the feature up (torchrec's rule)


def _reload_after_load(module: "CachedEmbeddingBagCollection", incompatible_keys) -> None:
    module._finish_load()


class CachedEmbeddingBagCollection(nn.Module):
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

    Ids must be in [0, num_embeddings) of their table, unless `hash_ids=True`, which maps every id to
    `id % num_embeddings` (torch ops on the ids' device). `id_freq` (per-table access counts, a list aligned
    with `tables` or a dict by table name) seeds the cache's frequency policy and warm-up.

    Example::

        >>> tables = [TableConfig("t1", 10, 3, ["f1"]), TableConfig("t2", 10, 3, ["f2"])]
        >>> ebc = CachedEmbeddingBagCollection(tables, cache_rows=4, optimizer=cachedemb.optim.SGD(0.1))
        >>> out = ebc({"f1": (torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2, 3])),   # bags [0,1], [], [2]
        ...            "f2": (torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 5]))})
        >>> out["f1"].shape                                 # one group (dim 3, sum): rows 0-9 t1, 10-19 t2
        torch.Size([3, 3])
    """

    def __init__(self, tables: Sequence, is_weighted: bool = False, device=None, *, cache_ratio: float = 0.01,
                 cache_rows: int | None = None, optimizer: SparseOptimizer | None = None, id_freq=None,
                 warmup_ratio: float = 0.7, policy: str | Policy = "lfu", hash_ids: bool = False,
                 validate_inputs: bool = True):
        super().__init__()
        self._configs = list(tables)
        self.tables: list[TableConfig] = self._check_tables(self._configs)
        self.hash_ids, self.is_weighted_, self.validate_inputs = bool(hash_ids), bool(is_weighted), validate_inputs
        self._bag_kwargs = dict(cache_ratio=cache_ratio, cache_rows=cache_rows, optimizer=optimizer,
                                warmup_ratio=warmup_ratio, policy=policy)
        self._freqs = self._check_id_freq(id_freq)
        shared = Counter(f for t in self.tables for f in t.feature_names)
        self._lookups = [_Lookup(i, f, f"{f}@{t.name}" if shared[f] > 1 else f)
                         for i, t in enumerate(self.tables) for f in t.feature_names]
        self.embedding_names: list[str] = [lk.name for lk in self._lookups]
        self.feature_names: list[str] = list(dict.fromkeys(lk.feature for lk in self._lookups))
        self._feature_index = {f: i for i, f in enumerate(self.feature_names)}
        self._dims = [self.tables[lk.table].embedding_dim for lk in self._lookups]
        self._plan_groups()
        self.bags = nn.ModuleList()
        self.embedding_bags = nn.ModuleDict({t.name: _TableView(self, i) for i, t in enumerate(self.tables)})
        self._pending_load: dict[int, int | None] = {}  # group -> loaded optimizer step (None: weights only)
        self.register_load_state_dict_post_hook(_reload_after_load)
        self._dense_index: dict = {}
        self._handle = 0
        self._device = self._resolve_device(device)
        if self._device.type != "meta":
            self._materialize(self._device, initialize=True)

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def _check_tables(configs) -> list[TableConfig]:
        tables = [TableConfig.from_config(c) for c in configs]
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
            members.setdefault((t.embedding_dim, t.pooling, t.dtype), []).append(i)
        self._groups: list[_Group] = []
        self._table_group: dict[int, tuple[int, int]] = {}  # table -> (group, row offset)
        self._lookup_slot: list[tuple[int, int]] = [(0, 0)] * len(self._lookups)  # lookup -> (group, position)
        for g, ((dim, pooling, dtype), tables) in enumerate(members.items()):
            offsets = [0]
            for i in tables:
                self._table_group[i] = (g, offsets[-1])
                offsets.append(offsets[-1] + self.tables[i].num_embeddings)
            lookups = tuple(k for k, lk in enumerate(self._lookups) if lk.table in tables)
            for j, k in enumerate(lookups):
                self._lookup_slot[k] = (g, j)
            self._groups.append(_Group(dim, pooling, dtype, tuple(tables), tuple(offsets[:-1]), offsets[-1],
                                       lookups))

    @staticmethod
    def _resolve_device(device) -> torch.device:
        """As torchrec: an explicit device, else the default device (`with torch.device(...)`); the plain CPU
        default means CUDA when there is one (where the cache belongs)."""
        if device is not None:
            return torch.device(device)
        default = torch.get_default_device() if hasattr(torch, "get_default_device") else torch.device("cpu")
        if default.type != "cpu":
            return default
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def _materialize(self, device: torch.device, initialize: bool) -> None:
        """Allocate the host tables and caches on `device`: initialized as torchrec, or zeroed (to_empty)."""
        with torch.device("cpu"):  # host tables and module scalars, whatever default device the caller set
            hosts = [pinned_empty((g.rows, g.dim), g.dtype) for g in self._groups]
            if initialize:
                for i, t in enumerate(self.tables):  # nn.EmbeddingBag's own init, as torchrec's EBC draws it
                    g, lo = self._table_group[i]
                    hosts[g][lo:lo + t.num_embeddings].normal_()
                for i, t in enumerate(self.tables):
                    g, lo = self._table_group[i]
                    t.initialize(hosts[g][lo:lo + t.num_embeddings])
            else:
                for host in hosts:
                    host.zero_()
            bags = nn.ModuleList()
            for group, host in zip(self._groups, hosts):
                freq = torch.cat([self._freqs[i] for i in group.tables]) if self._freqs is not None else None
                bag = _GroupBag(group.rows, group.dim, mode=group.pooling, include_last_offset=True, _weight=host,
                                dtype=group.dtype, device=device, id_freq=freq, validate_inputs=False,
                                **self._bag_kwargs)
                bag.cache.set_tables(list(group.row_offsets))
                bags.append(bag)
        self.bags = bags
        self._dense_index = {}

    def _apply(self, fn, recurse=True):
        """`.to(device)` / `to_empty(device=...)`: moves the caches (the host tables stay on the host); from
        meta, allocates the tables (zeroed: `reset_parameters()` initializes them); to meta, drops them."""
        probe = fn(torch.zeros(1, device="cpu"))
        if probe.is_floating_point() and probe.dtype != torch.float32 and not self.bags:
            self.tables = [replace(t, dtype=probe.dtype) for t in self.tables]
            self._plan_groups()
        if probe.device.type == "meta":
            self.bags = nn.ModuleList()
        elif not self.bags and self.tables:
            self._materialize(probe.device, initialize=False)
        else:
            super()._apply(fn, recurse)
        self._device = probe.device
        self._dense_index = {}
        return self

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
        for i, t in enumerate(self.tables):
            if self.bags:
                t.initialize(self._table_rows(i))

    def __prepare_scriptable__(self):
        raise NotScriptableError(
            "torch.jit.script cannot compile CachedEmbeddingBagCollection: its device cache is Python-side state "
            "(admission, eviction, write-back to the host table) that TorchScript cannot express. For a "
            "TorchScript model, script `collection.to_embedding_bag_collection()` (a torchrec "
            "EmbeddingBagCollection holding a copy of the tables); to capture a graph with the cache in it, use "
            "torch.fx.symbolic_trace or torch.export.export(..., strict=False).")

    def to_embedding_bag_collection(self, device=None):
        """A torchrec EmbeddingBagCollection with a copy of the tables (for TorchScript, serving or a peer
        comparison); needs every table to fit where it goes. torchrec keeps BF16 tables as float16."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.types import DataType

        names = {dtype: name for name, dtype in _DTYPES.items()}
        configs = [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                      feature_names=list(t.feature_names), pooling=PoolingType[t.pooling.upper()],
                                      data_type=DataType[names[t.dtype]]) for t in self.tables]
        device = torch.device(device or "cpu")
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            ebc = EmbeddingBagCollection(configs, is_weighted=self.is_weighted_, device=device)
        if self.bags:
            with torch.no_grad():
                for i, t in enumerate(self.tables):
                    ebc.embedding_bags[t.name].weight.copy_(self._host_rows(i))
        return ebc

    # ----------------------------------------------------------------- forward
    def forward(self, features, jagged: str = "offsets"):
        if isinstance(features, torch.fx.Proxy):
            return self._traced_forward(features)
        if _is_exporting():
            return self._exported_forward(features)
        if torch.compiler.is_compiling():
            return _eager_outside_dynamo(self, features, jagged)
        return self._eager_forward(features, jagged)

    def _eager_forward(self, features, jagged: str = "offsets"):
        is_kjt = _is_torchrec(features, "KeyedJaggedTensor")
        if not self.bags:
            return self._unmaterialized_output(features, jagged, is_kjt)
        batch, inputs = self._group_inputs(features, jagged)
        pooled = [bag(ids, offsets, psw).view(len(group.lookups), batch, group.dim).float()
                  for bag, group, (ids, offsets, psw) in zip(self.bags, self._groups, inputs)]
        if is_kjt:
            return self._keyed_tensor(self._concat(pooled, batch, inputs[0][0].device))
        return {lk.name: pooled[g][j] for lk, (g, j) in zip(self._lookups, self._lookup_slot)}

    def _concat(self, pooled: list, batch: int, device) -> torch.Tensor:
        """[B, sum(dims)] in output order from per-group [lookups, B, dim]."""
        if not self._lookups:
            return torch.zeros(batch, 0, device=device)
        return torch.cat([pooled[g][j] for g, j in self._lookup_slot], dim=1)

    def _keyed_tensor(self, values: torch.Tensor):
        return _torchrec_type("KeyedTensor")(keys=list(self.embedding_names), length_per_key=list(self._dims),
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
            elif _is_torchrec(first, "JaggedTensor"):
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
        if _torchrec_type("KeyedTensor") is None:
            raise TypeError("torch.fx tracing of CachedEmbeddingBagCollection takes a torchrec KeyedJaggedTensor "
                            "input (import torchrec); other input forms are not traceable")
        if getattr(getattr(features, "tracer", None), "root", None) is self:  # the collection is the traced root
            return self._keyed_tensor(_fx_lookup_live(self._export_handle(), features))
        return self._keyed_tensor(_fx_lookup(self, features))

    def _exported_forward(self, features):
        """Under torch.export: the lookup as the custom op cachedemb::collection_lookup (the live collection)."""
        if not _is_torchrec(features, "KeyedJaggedTensor"):
            raise TypeError("torch.export of CachedEmbeddingBagCollection takes a torchrec KeyedJaggedTensor input, "
                            f"got {type(features).__name__}")
        weights = features.weights_or_none() if self.is_weighted_ else None
        values = torch.ops.cachedemb.collection_lookup(self._export_handle(), list(features.keys()),
                                                       features.values(), features.lengths(), weights)
        return self._keyed_tensor(values)

    def _export_handle(self) -> int:
        if _LIVE.get(self._handle) is not self:  # first export, or a copy of an exported collection
            self._handle = next(_HANDLES)
            _LIVE[self._handle] = self
        return self._handle

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
        _, inputs = self._jagged_inputs(per_feature)
        pooled = [bag(ids, offsets, psw).view(len(group.lookups), batch, group.dim).float()
                  for bag, group, (ids, offsets, psw) in zip(self.bags, self._groups, inputs)]
        return self._concat(pooled, batch, values.device)

    def prefetch_targets(self, features, jagged: str = "offsets") -> list:
        """(cache, ids in its row space) per group for `features` (any forward input form): the protocol of
        `cachedemb.prefetch`, which admits a window's rows ahead of the forwards."""
        _, inputs = self._group_inputs(features, jagged)
        return [(bag.cache, ids) for bag, (ids, _, _) in zip(self.bags, inputs)]

    def _group_inputs(self, features, jagged: str):
        """(batch size, [(ids, offsets with the end, per_sample_weights)] per group): one bag per (lookup,
        sample), lookup-major, ids shifted into the group's row space."""
        if torch.is_tensor(features):
            return self._dense_inputs(features)
        if _is_torchrec(features, "KeyedJaggedTensor"):
            return self._jagged_inputs(self._split_kjt(features))
        if isinstance(features, Mapping):
            return self._jagged_inputs(self._split_dict(features, jagged))
        raise TypeError("features must be a torchrec KeyedJaggedTensor, a dict {feature: (values, offsets)} or a "
                        f"2-D id tensor [batch, features], got {type(features).__name__}")

    def _check_keys(self, keys, allow_unknown: bool = False) -> None:
        keys = list(keys)
        unknown = [k for k in keys if k not in self._feature_index]
        if unknown and not allow_unknown:
            raise ValueError(f"unknown feature(s) {unknown}: this collection's features are {self.feature_names}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicated feature keys in the input: {keys}")
        present = set(keys)
        missing = [f for f in self.feature_names if f not in present]
        if missing:
            raise ValueError(f"missing feature(s) {missing}: every feature of every table must be in the input")

    def _split_kjt(self, kjt) -> dict:
        """Per used key (values, offsets, weights); keys no table uses are ignored, as torchrec does."""
        keys = kjt.keys()
        self._check_keys(keys, allow_unknown=True)
        if kjt.variable_stride_per_key():
            raise ValueError("variable batch size per feature (VBE) KeyedJaggedTensors are not supported")
        if self.is_weighted_ and kjt.weights_or_none() is None:
            raise ValueError("is_weighted=True but the KeyedJaggedTensor has no weights")
        batch = kjt.stride()
        values, offsets = kjt.values(), kjt.offsets()
        weights = kjt.weights_or_none() if self.is_weighted_ else None
        out = {}
        # torchrec's per-key offsets: host ints its input pipelines fill in (computed, with one sync, only
        # when a KJT arrives without them).
        key_offsets = kjt.offset_per_key()
        for i, key in enumerate(keys):
            if key not in self._feature_index:
                continue
            lo, hi = key_offsets[i], key_offsets[i + 1]
            offs = offsets[i * batch:(i + 1) * batch + 1] - offsets[i * batch]
            out[key] = (values[lo:hi], offs, weights[lo:hi] if weights is not None else None)
        return out

    def _split_dict(self, features: Mapping, jagged: str) -> dict:
        if jagged not in ("offsets", "lengths"):
            raise ValueError(f"jagged must be 'offsets' or 'lengths', got {jagged!r}")
        self._check_keys(features.keys())
        out, batch = {}, None
        for key, item in features.items():
            weights = None
            if _is_torchrec(item, "JaggedTensor"):
                values, offs = item.values(), item.offsets()
                weights = item.weights_or_none() if self.is_weighted_ else None
            elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
                values, second = item[0], item[1]
                weights = item[2] if len(item) == 3 else None
                if not (torch.is_tensor(values) and torch.is_tensor(second)) or second.dim() != 1:
                    raise ValueError(f"feature {key!r}: expected (values, {jagged}) 1-D tensors")
                if jagged == "lengths":
                    offs = torch.cat([second.new_zeros(1), second.cumsum(0)])
                else:
                    offs = second
                    if offs.numel() == 0 or (self._check_values(offs) and (
                            int(offs[0]) != 0 or int(offs[-1]) != values.numel())):
                        raise ValueError(f"feature {key!r}: offsets must have batch + 1 entries from 0 to "
                                         f"len(values)={values.numel()}, got {offs.tolist()[:8]}...; for "
                                         "lengths pass jagged='lengths'")
            else:
                raise ValueError(f"feature {key!r}: expected a (values, {jagged}) tuple or a JaggedTensor, "
                                 f"got {type(item).__name__}")
            if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"feature {key!r}: values must be a 1-D int32/int64 tensor, got "
                                 f"{values.dtype} shape {tuple(values.shape)}")
            if batch is None:
                batch = offs.numel() - 1
            elif offs.numel() - 1 != batch:
                raise ValueError(f"feature {key!r} has batch size {offs.numel() - 1}, others {batch}")
            out[key] = (values, offs, weights)
        return out

    def _check_values(self, t: torch.Tensor) -> bool:
        """Whether inputs are checked on the host: when asked, or where it is free (CPU, not sync-free).
        Unchecked ids are bounds-checked on the device by each group's module (counted as invalid_ids)."""
        return self.validate_inputs or counts_on_host(t.device)

    def _table_ids(self, lookup: int, ids: torch.Tensor) -> torch.Tensor:
        """Ids of one lookup, hashed or range-checked, as rows of its table."""
        table = self.tables[self._lookups[lookup].table]
        ids = ids.to(torch.int64)
        if self.hash_ids:
            return torch.remainder(ids, table.num_embeddings)
        if self._check_values(ids) and ids.numel() > 0:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.num_embeddings:
                bad = lo if lo < 0 else hi
                raise ValueError(f"feature {self._lookups[lookup].feature!r} (table {table.name!r}): id {bad} is "
                                 f"out of range [0, {table.num_embeddings}); pass hash_ids=True to fold ids "
                                 "into the table")
            return ids
        # Unchecked: an id outside its table must not land in a neighbour's rows of the shared group table.
        return torch.where((ids < 0) | (ids >= table.num_embeddings), torch.full_like(ids, _OUT_OF_GROUP), ids)

    def _jagged_inputs(self, per_feature: dict):
        inputs, batch = [], None
        for group in self._groups:
            ids, lengths, weights = [], [], []
            for k in group.lookups:
                lk = self._lookups[k]
                values, offs, w = per_feature[lk.feature]
                batch = offs.numel() - 1
                row_off = self._table_group[lk.table][1]
                ids.append(self._table_ids(k, values) + row_off)
                lengths.append(offs[1:] - offs[:-1])
                weights.append(w)
            lengths = torch.cat(lengths).to(torch.int64)
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            psw = None
            if self.is_weighted_:
                if any(w is None for w in weights):
                    raise ValueError("is_weighted=True but some feature has no weights")
                # One KJT carries one weights tensor for tables of any dtype: cast to this group's.
                psw = torch.cat(weights).to(group.dtype)
            inputs.append((torch.cat(ids), offsets, psw))
        if batch is None:
            batch = next((offs.numel() - 1 for _, offs, _ in per_feature.values()), 0)
        return batch, inputs

    def _dense_index_for(self, g: int, device: torch.device):
        """(columns, row offsets, table sizes) of group g's lookups for the 2-D input, cached per device."""
        key = (g, device)
        if key not in self._dense_index:
            lookups = [self._lookups[k] for k in self._groups[g].lookups]
            cols = [self._feature_index[lk.feature] for lk in lookups]
            offs = [self._table_group[lk.table][1] for lk in lookups]
            sizes = [self.tables[lk.table].num_embeddings for lk in lookups]
            self._dense_index[key] = (cols, torch.tensor(offs, dtype=torch.int64, device=device),
                                      torch.tensor(sizes, dtype=torch.int64, device=device))
        return self._dense_index[key]

    def _dense_inputs(self, ids: torch.Tensor):
        if ids.dim() != 2 or ids.shape[1] != len(self.feature_names) or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a tensor input must be 2-D int [batch, {len(self.feature_names)}] (one id per "
                             f"feature in {self.feature_names}), got {ids.dtype} shape {tuple(ids.shape)}")
        ids = ids.to(torch.int64)
        inputs = []
        for g, group in enumerate(self._groups):
            columns, row_offsets, sizes = self._dense_index_for(g, ids.device)
            cols = ids[:, columns] if columns != list(range(ids.shape[1])) else ids
            if self.hash_ids:
                cols = torch.remainder(cols, sizes)
            elif self._check_values(cols) and cols.numel() > 0:
                bad = (cols < 0) | (cols >= sizes)
                if bool(bad.any()):
                    j = int(torch.nonzero(bad.any(0))[0, 0])
                    self._table_ids(group.lookups[j], cols[:, j])  # raises, naming the feature and table
            else:
                cols = torch.where((cols < 0) | (cols >= sizes), torch.full_like(cols, _OUT_OF_GROUP), cols)
            flat = (cols + row_offsets).t().reshape(-1)
            offsets = torch.arange(flat.numel() + 1, dtype=torch.int64, device=ids.device)
            inputs.append((flat, offsets, None))
        return ids.shape[0], inputs

    # ----------------------------------------------------------------- cache and tables
    def cache_stats(self) -> dict:
        """Cache counters (and `seconds` of cache operations) summed over the groups (a host sync on CUDA)."""
        total: dict = {"seconds": {}}
        for bag in self.bags:
            for k, v in bag.cache_stats().items():
                if k == "seconds":
                    for op, sec in v.items():
                        total["seconds"][op] = total["seconds"].get(op, 0.0) + sec
                else:
                    total[k] = total.get(k, 0) + v
        return total

    def reset_cache_stats(self) -> None:
        for bag in self.bags:
            bag.reset_cache_stats()

    def flush(self) -> None:
        """Write every dirty cached row (and optimizer state) back to the host tables."""
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
        if not self.bags:
            return torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype, device=_META)
        g, lo = self._table_group[i]
        return self.bags[g].weight[lo:lo + t.num_embeddings]

    def _host_rows(self, i: int) -> torch.Tensor:
        """Table i's rows in the host table after a flush, without handing the group's weight out."""
        g, lo = self._table_group[i]
        self.bags[g].flush()
        return self.bags[g].cache.host_weight[lo:lo + self.tables[i].num_embeddings]

    # ----------------------------------------------------------------- state dict (torchrec EBC keys)
    def _save_table(self, i: int, destination, prefix: str) -> None:
        """`{prefix}weight` (as torchrec's EBC) and, with a fused optimizer, `{prefix}optimizer.{state}` and
        `{prefix}optimizer.step`. Values are views of host tables."""
        if not self.bags:
            destination[prefix + "weight"] = self._table_rows(i)
            return
        g, lo = self._table_group[i]
        bag, hi = self.bags[g], lo + self.tables[i].num_embeddings
        destination[prefix + "weight"] = self._host_rows(i)
        if bag.optimizer is not None:
            for name, state in bag.cache.host_states.items():
                destination[prefix + f"optimizer.{name}"] = state[lo:hi]
            destination[prefix + _STEP] = torch.tensor(bag.optimizer_step, dtype=torch.int64, device="cpu")

    def _load_table(self, i: int, state_dict, prefix: str, missing_keys, unexpected_keys, error_msgs) -> None:
        t = self.tables[i]
        known = {prefix + "weight"}
        writes = []  # (key, value, host tensor, lo)
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
        for key, value, host, in writes:
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


# ----------------------------------------------------------------- graph capture
def _is_exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting()) if is_exporting is not None else False


def _eager_call(module: CachedEmbeddingBagCollection, features, jagged: str):
    return module._eager_forward(features, jagged)


# Under torch.compile the lookup runs eagerly (torch._dynamo imported lazily, on the first compiled call).
_eager_outside_dynamo = torch._disable_dynamo(_eager_call)


def _fx_lookup(module: CachedEmbeddingBagCollection, features) -> torch.Tensor:
    """One node of an fx graph: the collection's lookup of a KeyedJaggedTensor -> float32 [B, sum(dims)]."""
    return module._eager_forward(features).values()


def _fx_lookup_live(handle: int, features) -> torch.Tensor:
    """As _fx_lookup when the collection is the traced root itself (a GraphModule cannot hold its own root):
    the graph names the live collection by its handle."""
    return _fx_lookup(_live_collection(handle), features)


torch.fx.wrap("_fx_lookup")
torch.fx.wrap("_fx_lookup_live")

_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # export handle -> collection
_HANDLES = itertools.count(1)


def _live_collection(handle: int) -> CachedEmbeddingBagCollection:
    module = _LIVE.get(handle)
    if module is None:
        raise RuntimeError(f"cachedemb::collection_lookup: collection {handle} no longer exists; an exported "
                           "program runs the live CachedEmbeddingBagCollection it was exported from, in its "
                           "process")
    return module


@torch.library.custom_op("cachedemb::collection_lookup", mutates_args=(),
                         schema="(int handle, str[] keys, Tensor values, Tensor lengths, Tensor? weights) -> Tensor")
def _collection_lookup(handle, keys, values, lengths, weights):
    with torch.no_grad():
        return _live_collection(handle)._lookup_jagged(list(keys), values, lengths, weights)


@_collection_lookup.register_fake
def _collection_lookup_fake(handle, keys, values, lengths, weights):
    module = _live_collection(handle)
    batch = lengths.shape[0] // max(len(keys), 1)
    return values.new_empty((batch, sum(module._dims)), dtype=torch.float32)


__all__ = ["TableConfig", "CachedEmbeddingBagCollection", "NotScriptableError"]
