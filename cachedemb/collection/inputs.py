"""The input forms of CachedEmbeddingBagCollection -> per group one bag per (lookup, sample), lookup-major,
ids shifted into the group's row space: a KeyedJaggedTensor (keys no table uses ignored, as torchrec), a dict
{feature: (values, offsets | lengths) or JaggedTensor}, or a 2-D id tensor [B, features]. Ids are range-checked
on the host where that is free or asked for, hashed with `hash_ids`, and otherwise made harmless on the device."""
from __future__ import annotations

import sys
from collections.abc import Mapping

import torch

from cachedemb.cache.sync_mode import counts_on_host

# An unchecked id outside its table becomes this (still negative after the table's row offset is added), which
# the group's module turns into a padding lookup and counts as invalid.
OUT_OF_GROUP = -(1 << 62)


def torchrec_type(name: str):
    """A torchrec sparse type, only if torchrec is already imported: importing it costs seconds, and an input
    can only be a KeyedJaggedTensor / JaggedTensor if the caller imported torchrec to build it."""
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    return getattr(module, name, None) if module is not None else None


def is_torchrec(obj, name: str) -> bool:
    cls = torchrec_type(name)
    return cls is not None and isinstance(obj, cls)


class CollectionInputs:
    """Input handling of CachedEmbeddingBagCollection (a mixin: it reads the collection's tables, lookups,
    groups and input options)."""

    def _group_inputs(self, features, jagged: str):
        """(batch size, [(ids, offsets with the end, per_sample_weights)] per group): one bag per (lookup,
        sample), lookup-major, ids shifted into the group's row space."""
        if torch.is_tensor(features):
            return self._dense_inputs(features)
        if is_torchrec(features, "KeyedJaggedTensor"):
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
            if is_torchrec(item, "JaggedTensor"):
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
        if table.dynamic is not None:  # raw ids: every int64 is valid, the table's remap finds the rows
            return ids
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
        return torch.where((ids < 0) | (ids >= table.num_embeddings), torch.full_like(ids, OUT_OF_GROUP), ids)

    def _jagged_inputs(self, per_feature: dict):
        inputs, batch = [], None
        for bag, group in zip(self.bags, self._groups):
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
                psw = torch.cat(weights).to(bag.cache.dtype)
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
            if group.dynamic is not None:
                pass  # raw ids (row offset 0): the group's DynamicEmbeddingBag remaps them
            elif self.hash_ids:
                cols = torch.remainder(cols, sizes)
            elif self._check_values(cols) and cols.numel() > 0:
                bad = (cols < 0) | (cols >= sizes)
                if bool(bad.any()):
                    j = int(torch.nonzero(bad.any(0))[0, 0])
                    self._table_ids(group.lookups[j], cols[:, j])  # raises, naming the feature and table
            else:
                cols = torch.where((cols < 0) | (cols >= sizes), torch.full_like(cols, OUT_OF_GROUP), cols)
            flat = (cols + row_offsets).t().reshape(-1)
            offsets = torch.arange(flat.numel() + 1, dtype=torch.int64, device=ids.device)
            inputs.append((flat, offsets, None))
        return ids.shape[0], inputs
