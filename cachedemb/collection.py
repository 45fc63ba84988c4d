"""CachedEmbeddingBagCollection: torchrec's EmbeddingBagCollection interface over CachedEmbeddingBag.

Tables with the same (embedding_dim, pooling) share one CachedEmbeddingBag — one host table holding their rows
back to back (per-table row offsets) behind one device cache — so a model with 26 tables runs one cached
lookup per group, not per table. Each group's forward is a single call: the ids of all its features (plus
their table's row offset) concatenated feature-major, one bag per (feature, sample).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
# An unchecked id outside its table becomes this (still negative after the table's row offset is added), which
# the group's module turns into a padding lookup and counts as invalid.
_OUT_OF_GROUP = -(1 << 62)
_STEP = "optimizer.step"


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_embeddings` rows of `embedding_dim`, looked up by each of `feature_names`."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str = "sum"

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
        names = tuple(self.feature_names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"TableConfig {self.name!r}: feature_names must be non-empty strings, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"TableConfig {self.name!r}: duplicated feature names in {names!r}")
        object.__setattr__(self, "feature_names", names)
        if self.pooling not in _POOLINGS:
            raise ValueError(f"TableConfig {self.name!r}: pooling must be one of {_POOLINGS}, got {self.pooling!r}")


class _GroupBag(CachedEmbeddingBag):
    """A group's CachedEmbeddingBag; its state is saved and loaded per table by the collection."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Nothing under the group's own prefix: the collection writes per-table keys."""
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Nothing under the group's own prefix: the collection reads per-table keys."""
        return None


@dataclass(frozen=True)
class _Group:
    dim: int
    pooling: str
    tables: tuple[int, ...]  # indices into the collection's tables
    row_offsets: tuple[int, ...]  # first group row of each table
    features: tuple[int, ...]  # indices into the collection's feature_names, in output order


class CachedEmbeddingBagCollection(nn.Module):
    """A drop-in `torchrec.modules.embedding_modules.EmbeddingBagCollection` whose tables live in host memory.

    Tables are grouped by (embedding_dim, pooling); each group is one `CachedEmbeddingBag` with its own cache of
    `cache_rows` rows (default `cache_ratio` of the group's rows) and the fused `optimizer` (one of
    `cachedemb.optim`; None keeps the cached rows as a Parameter, see CachedEmbeddingBag). Tables are
    initialized as torchrec does: uniform in +-sqrt(1 / num_embeddings).

    Input, every feature of every table present, each with the same batch size B:

    * a torchrec `KeyedJaggedTensor` (offsets include the end, per key then per sample) -> `KeyedTensor`
      with keys in torchrec's order (tables in order, each table's feature_names) and values [B, sum(dims)];
    * a dict {feature: (values, offsets)} with offsets of B + 1 entries (offsets[0] == 0,
      offsets[-1] == len(values)); with `jagged="lengths"`, {feature: (values, lengths)} with B lengths; a
      torchrec JaggedTensor also works -> dict {feature: pooled [B, dim]};
    * a 2-D integer tensor [B, num_features], one id per (sample, feature), columns in `feature_names` order
      -> dict {feature: pooled [B, dim]}.

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

    def __init__(self, tables: Sequence[TableConfig], *, cache_ratio: float = 0.01, cache_rows: int | None = None,
                 optimizer: SparseOptimizer | None = None, device=None, id_freq=None, warmup_ratio: float = 0.7,
                 policy: str | Policy = "lfu", hash_ids: bool = False, is_weighted: bool = False,
                 validate_inputs: bool = True):
        super().__init__()
        self.tables = self._check_tables(tables)
        self.hash_ids, self.is_weighted_, self.validate_inputs = bool(hash_ids), bool(is_weighted), validate_inputs
        self.feature_names: list[str] = [f for t in self.tables for f in t.feature_names]
        self._feature_table = [i for i, t in enumerate(self.tables) for _ in t.feature_names]
        freqs = self._check_id_freq(id_freq)
        groups: dict[tuple[int, str], list[int]] = {}
        for i, t in enumerate(self.tables):
            groups.setdefault((t.embedding_dim, t.pooling), []).append(i)
        self._groups: list[_Group] = []
        self._table_group: dict[int, tuple[int, int]] = {}  # table -> (group, row offset)
        self.bags = nn.ModuleList()
        for g, ((dim, pooling), members) in enumerate(groups.items()):
            offsets = [0]
            for i in members:
                offsets.append(offsets[-1] + self.tables[i].num_embeddings)
                self._table_group[i] = (g, offsets[-2])
            features = tuple(f for f, t in enumerate(self._feature_table) if t in members)
            self._groups.append(_Group(dim, pooling, tuple(members), tuple(offsets[:-1]), features))
            total = offsets[-1]
            weight = pinned_empty((total, dim), torch.float32)
            for i, lo in zip(members, offsets):
                bound = math.sqrt(1.0 / self.tables[i].num_embeddings)
                weight[lo:lo + self.tables[i].num_embeddings].uniform_(-bound, bound)
            freq = None
            if freqs is not None:
                freq = torch.cat([freqs[i] for i in members])
            self.bags.append(_GroupBag(total, dim, mode=pooling, include_last_offset=True, _weight=weight,
                                       device=device, cache_ratio=cache_ratio, cache_rows=cache_rows,
                                       optimizer=optimizer, id_freq=freq, warmup_ratio=warmup_ratio,
                                       policy=policy, validate_inputs=False))
            self.bags[-1].cache.set_tables(offsets[:-1])
        # Per-feature (row offset, table size) as tensors for the 2-D fast path, per group.
        for g, group in enumerate(self._groups):
            offs = [self._table_group[self._feature_table[f]][1] for f in group.features]
            sizes = [self.tables[self._feature_table[f]].num_embeddings for f in group.features]
            self.register_buffer(f"_row_offsets_{g}", torch.tensor(offs, dtype=torch.int64), persistent=False)
            self.register_buffer(f"_sizes_{g}", torch.tensor(sizes, dtype=torch.int64), persistent=False)
        self._feature_index = {f: i for i, f in enumerate(self.feature_names)}

    # ----------------------------------------------------------------- construction helpers
    @staticmethod
    def _check_tables(tables) -> list[TableConfig]:
        tables = list(tables)
        if not tables:
            raise ValueError("CachedEmbeddingBagCollection needs at least one TableConfig, got none")
        for t in tables:
            if not isinstance(t, TableConfig):
                raise TypeError(f"tables must be cachedemb.collection.TableConfig, got {type(t).__name__}")
        seen_tables, seen_features = set(), {}
        for t in tables:
            if t.name in seen_tables:
                raise ValueError(f"duplicated table name {t.name!r}")
            seen_tables.add(t.name)
            for f in t.feature_names:
                if f in seen_features:
                    raise ValueError(f"duplicated feature name {f!r}: in table {seen_features[f]!r} and table "
                                     f"{t.name!r}; each feature may be looked up by one table")
                seen_features[f] = t.name
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
                out.append(torch.zeros(t.num_embeddings, dtype=torch.int64))
                continue
            freq = torch.as_tensor(freq)
            if freq.shape != (t.num_embeddings,):
                raise ValueError(f"id_freq of table {t.name!r} must have shape ({t.num_embeddings},), "
                                 f"got {tuple(freq.shape)}")
            out.append(freq.to(torch.int64))
        return out

    # ----------------------------------------------------------------- torchrec interface
    def embedding_bag_configs(self) -> list:
        """The tables as torchrec `EmbeddingBagConfig`s (so torchrec's DLRM accepts this collection)."""
        try:
            from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        except ImportError as err:
            raise RuntimeError("embedding_bag_configs() needs torchrec; install it or use .tables") from err
        pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
        return [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                   feature_names=list(t.feature_names), pooling=pooling[t.pooling])
                for t in self.tables]

    def is_weighted(self) -> bool:
        return self.is_weighted_

    @property
    def device(self) -> torch.device:
        return self.bags[0].cache.device

    # ----------------------------------------------------------------- forward
    def forward(self, features, jagged: str = "offsets"):
        is_kjt = _is_torchrec(features, "KeyedJaggedTensor")
        batch, inputs = self._group_inputs(features, jagged)
        out: dict[str, torch.Tensor] = {}
        for g, (group, (ids, offsets, psw)) in enumerate(zip(self._groups, inputs)):
            pooled = self.bags[g](ids, offsets, psw).view(len(group.features), batch, group.dim)
            for j, f in enumerate(group.features):
                out[self.feature_names[f]] = pooled[j]
        if is_kjt:
            values = torch.cat([out[f] for f in self.feature_names], dim=1)
            dims = [self.tables[t].embedding_dim for t in self._feature_table]
            return _torchrec_type("KeyedTensor")(keys=list(self.feature_names), length_per_key=dims, values=values)
        return {f: out[f] for f in self.feature_names}

    def prefetch_targets(self, features, jagged: str = "offsets") -> list:
        """(cache, ids in its row space) per group for `features` (any forward input form): the protocol of
        `cachedemb.prefetch`, which admits a window's rows ahead of the forwards."""
        _, inputs = self._group_inputs(features, jagged)
        return [(bag.cache, ids) for bag, (ids, _, _) in zip(self.bags, inputs)]

    def _group_inputs(self, features, jagged: str):
        """(batch size, [(ids, offsets with the end, per_sample_weights)] per group): one bag per (feature,
        sample), feature-major, ids shifted into the group's row space."""
        if torch.is_tensor(features):
            return self._dense_inputs(features)
        if _is_torchrec(features, "KeyedJaggedTensor"):
            return self._jagged_inputs(self._split_kjt(features))
        if isinstance(features, Mapping):
            return self._jagged_inputs(self._split_dict(features, jagged))
        raise TypeError("features must be a torchrec KeyedJaggedTensor, a dict {feature: (values, offsets)} or a "
                        f"2-D id tensor [batch, features], got {type(features).__name__}")

    def _check_keys(self, keys) -> None:
        keys = list(keys)
        unknown = [k for k in keys if k not in self._feature_index]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}: this collection's features are {self.feature_names}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicated feature keys in the input: {keys}")
        missing = [f for f in self.feature_names if f not in set(keys)]
        if missing:
            raise ValueError(f"missing feature(s) {missing}: every feature of every table must be in the input")

    def _split_kjt(self, kjt) -> dict:
        self._check_keys(kjt.keys())
        if kjt.variable_stride_per_key():
            raise ValueError("variable batch size per feature (VBE) KeyedJaggedTensors are not supported")
        batch = kjt.stride()
        values, offsets = kjt.values(), kjt.offsets()
        weights = kjt.weights_or_none() if self.is_weighted_ else None
        out = {}
        # torchrec's per-key offsets: host ints its input pipelines fill in (computed, with one sync, only
        # when a KJT arrives without them).
        key_offsets = kjt.offset_per_key()
        for i, key in enumerate(kjt.keys()):
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

    def _table_ids(self, feature: int, ids: torch.Tensor) -> torch.Tensor:
        """Ids of one feature, hashed or range-checked, as rows of its table."""
        table = self.tables[self._feature_table[feature]]
        ids = ids.to(torch.int64)
        if self.hash_ids:
            return torch.remainder(ids, table.num_embeddings)
        if self._check_values(ids) and ids.numel() > 0:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.num_embeddings:
                bad = lo if lo < 0 else hi
                raise ValueError(f"feature {self.feature_names[feature]!r} (table {table.name!r}): id {bad} is "
                                 f"out of range [0, {table.num_embeddings}); pass hash_ids=True to fold ids "
                                 "into the table")
            return ids
        # Unchecked: an id outside its table must not land in a neighbour's rows of the shared group table.
        return torch.where((ids < 0) | (ids >= table.num_embeddings), torch.full_like(ids, _OUT_OF_GROUP), ids)

    def _jagged_inputs(self, per_feature: dict):
        inputs, batch = [], None
        for group in self._groups:
            ids, lengths, weights = [], [], []
            for f in group.features:
                values, offs, w = per_feature[self.feature_names[f]]
                batch = offs.numel() - 1
                row_off = self._table_group[self._feature_table[f]][1]
                ids.append(self._table_ids(f, values) + row_off)
                lengths.append(offs[1:] - offs[:-1])
                weights.append(w)
            lengths = torch.cat(lengths).to(torch.int64)
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            psw = None
            if self.is_weighted_:
                if any(w is None for w in weights):
                    raise ValueError("is_weighted=True but some feature has no weights")
                psw = torch.cat(weights)
            inputs.append((torch.cat(ids), offsets, psw))
        return batch, inputs

    def _dense_inputs(self, ids: torch.Tensor):
        if ids.dim() != 2 or ids.shape[1] != len(self.feature_names) or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a tensor input must be 2-D int [batch, {len(self.feature_names)}] (one id per "
                             f"feature in {self.feature_names}), got {ids.dtype} shape {tuple(ids.shape)}")
        ids = ids.to(torch.int64)
        inputs = []
        for g, group in enumerate(self._groups):
            cols = ids[:, list(group.features)] if len(group.features) != ids.shape[1] else ids
            sizes = getattr(self, f"_sizes_{g}").to(ids.device)
            if self.hash_ids:
                cols = torch.remainder(cols, sizes)
            elif self._check_values(cols) and cols.numel() > 0:
                bad = (cols < 0) | (cols >= sizes)
                if bool(bad.any()):
                    j = int(torch.nonzero(bad.any(0))[0, 0])
                    self._table_ids(group.features[j], cols[:, j])  # raises, naming the feature and table
            else:
                cols = torch.where((cols < 0) | (cols >= sizes), torch.full_like(cols, _OUT_OF_GROUP), cols)
            flat = (cols + getattr(self, f"_row_offsets_{g}").to(ids.device)).t().reshape(-1)
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
        """The full table `name` (a host view into its group's table; flushes first)."""
        i = self._table_index(name)
        g, lo = self._table_group[i]
        return self.bags[g].weight[lo:lo + self.tables[i].num_embeddings]

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise ValueError(f"unknown table {name!r}; tables are {[t.name for t in self.tables]}")

    # ----------------------------------------------------------------- state dict (torchrec EBC keys)
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """`embedding_bags.{table}.weight` (as torchrec's EBC) and, with a fused optimizer,
        `embedding_bags.{table}.optimizer.{state}` and `...optimizer.step`. Values are views of host tables."""
        self.flush()
        for i, t in enumerate(self.tables):
            g, lo = self._table_group[i]
            cache, bag = self.bags[g].cache, self.bags[g]
            key = f"{prefix}embedding_bags.{t.name}."
            hi = lo + t.num_embeddings
            destination[key + "weight"] = cache.host_weight[lo:hi]
            if bag.optimizer is not None:
                for name, state in cache.host_states.items():
                    destination[key + f"optimizer.{name}"] = state[lo:hi]
                destination[key + _STEP] = torch.tensor(bag.optimizer_step, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        known = set()
        writes = []  # (host tensor slice, value): applied only if every shape is right
        steps: dict[int, int] = {}
        for i, t in enumerate(self.tables):
            g, lo = self._table_group[i]
            cache, bag = self.bags[g].cache, self.bags[g]
            hi = lo + t.num_embeddings
            key = f"{prefix}embedding_bags.{t.name}."
            known.add(key + "weight")
            if key + "weight" not in state_dict:
                missing_keys.append(key + "weight")
            else:
                writes.append((key + "weight", cache.host_weight, lo, hi, state_dict[key + "weight"]))
            for name, state in cache.host_states.items():
                known.add(key + f"optimizer.{name}")
                if key + f"optimizer.{name}" in state_dict:
                    writes.append((key + f"optimizer.{name}", state, lo, hi, state_dict[key + f"optimizer.{name}"]))
            if bag.optimizer is not None:
                known.add(key + _STEP)
                if key + _STEP in state_dict:
                    steps[g] = max(steps.get(g, 0), int(state_dict[key + _STEP]))
        bad = False
        for name, host, lo, hi, value in writes:
            expected = (hi - lo, host.shape[1])
            if tuple(value.shape) != expected:
                error_msgs.append(f"size mismatch for {name}: expected {expected}, got {tuple(value.shape)}")
                bad = True
        if strict:
            for k in state_dict:
                if k.startswith(prefix) and k not in known and k[len(prefix):].split(".", 1)[0] not in self._modules:
                    unexpected_keys.append(k)
        if bad:
            return
        self.flush()
        for _, host, lo, hi, value in writes:
            host[lo:hi].copy_(value)
        for g, step in steps.items():
            self.bags[g].optimizer_step = step
        for bag in self.bags:
            bag.cache.reload()

    def extra_repr(self) -> str:
        groups = ", ".join(f"(dim={g.dim}, {g.pooling}: {[self.tables[i].name for i in g.tables]})"
                           for g in self._groups)
        return f"tables={len(self.tables)}, groups=[{groups}], hash_ids={self.hash_ids}"


__all__ = ["TableConfig", "CachedEmbeddingBagCollection"]
