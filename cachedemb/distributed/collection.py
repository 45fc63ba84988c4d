"""ShardedEmbeddingBagCollection: a CachedEmbeddingBagCollection's tables placed over the ranks.

Each table becomes a ShardedEmbeddingBag of its own (`embedding_bags[table]`; a dynamic-id table a
ShardedDynamicEmbeddingBag, its ids hashed to their owner ranks, no plan entry), placed by the plan entry
`"<collection path>.<table>"` (table-wise by default: whole tables spread over the ranks; row-wise and
data-parallel work the same way). Per forward and per table, the bags of every feature the table serves go to
the table's owners in one exchange (features concatenated feature-major, so one fused-optimizer step per
table per step, as the unsharded group's), and the pooled rows come back by all-to-all::

    KJT (local batch B_me) ──per table: values of its features, lengths -> offsets──> ShardedEmbeddingBag
        ──[features x B_me, dim] split per feature──> KeyedTensor [B_me, sum(dims)] in the collection's key order

State keys are the collection's (`embedding_bags.<table>.weight`, `.optimizer.<state>`, `.optimizer.step`), so
gather_full_state_dict returns what the unsharded collection loads.
"""
from __future__ import annotations

import torch
from torch import nn

from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection
from cachedemb.collection.inputs import is_torchrec, torchrec_type
from cachedemb.distributed.plan import TableSharding
from cachedemb.distributed.bag import ShardedEmbeddingBag
from cachedemb.distributed.dynamic import ShardedDynamicEmbeddingBag
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.modules.cache_stats import sum_stats


def _table_module(collection: CachedEmbeddingBagCollection, index: int) -> CachedEmbeddingBag:
    """A standalone CachedEmbeddingBag holding table `index`'s current rows and optimizer state; for a
    collection on the meta device, a meta one drawn as the collection's `reset_parameters()` draws it."""
    t = collection.tables[index]
    g, _ = collection._table_group[index]
    if not collection.bags:
        kw = collection._bag_kwargs
        group_capacity = CachedEmbeddingBag.cache_capacity(collection._groups[g].rows, kw["cache_ratio"],
                                                           collection._group_bag_kwargs(collection._groups[g])[
                                                               "cache_rows"])
        module = CachedEmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, device="meta",
                                    dtype=t.dtype, cache_rows=min(t.num_embeddings, group_capacity),
                                    optimizer=kw["optimizer"], warmup_ratio=0.0, _init=t.table_init())
        module._shard_local = True
        if collection.storage is not None:  # each rank's rows of the table go to a file of its own
            module.file_storage = collection.table_storage(index)
        return module
    if collection.storage is not None:
        raise ValueError("a collection with storage=FileStorage(...) is sharded from the meta device: build it with "
                         "device='meta' (shard() then creates each rank's file of its rows; built on a device, "
                         "every rank would hold whole-table files)")
    group_bag = collection.bags[g]
    state = {}
    collection._save_table(index, state, "")
    module = CachedEmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling, _weight=state["weight"].clone(),
                                device=group_bag.cache.device, dtype=group_bag.cache.dtype,
                                cache_rows=max(1, min(t.num_embeddings, group_bag.cache.capacity)),
                                optimizer=group_bag.optimizer, warmup_ratio=0.0)
    module._shard_local = True
    module.load_state_dict(state)
    return module


def _dynamic_table_module(collection: CachedEmbeddingBagCollection, index: int) -> DynamicEmbeddingBag:
    """A standalone DynamicEmbeddingBag with dynamic table `index`'s ids, rows and state (its group bag saves
    nothing itself: the table's view does)."""
    if not collection.bags:
        raise ValueError(f"dynamic table {collection.tables[index].name!r} of a collection on the meta device: "
                         "materialize the collection first (its rows are made per id on admission anyway)")
    t = collection.tables[index]
    bag = collection.bags[collection._table_group[index][0]]
    module = DynamicEmbeddingBag(None, t.embedding_dim, mode=t.pooling, dtype=bag.cache.dtype,
                                 device=bag.cache.device, dynamic=t.dynamic, optimizer=bag.optimizer,
                                 cache_rows=bag.cache.capacity,
                                 in_flight_rows=bag.row_ids.numel() - t.dynamic.capacity, validate_inputs=False)
    module.inner._shard_local = True
    state: dict = {}
    collection._save_table(index, state, "")
    module.load_state_dict(state)
    module.train(collection.training)
    return module


class ShardedEmbeddingBagCollection(nn.Module):
    """The sharded equivalent of a CachedEmbeddingBagCollection: KJT (or dict {feature: (values, offsets)}) in,
    KeyedTensor (or dict {key: pooled}) out, each rank with its own local batch size."""

    def __init__(self, collection: CachedEmbeddingBagCollection, shardings: dict[str, TableSharding], group=None,
                 device=None):
        super().__init__()
        self.tables = list(collection.tables)
        self.embedding_names = list(collection.embedding_names)
        self.hash_ids = collection.hash_ids
        self._dims = list(collection._dims)
        self.feature_names = list(collection.feature_names)
        self._lookups = [(lk.table, lk.feature, lk.name) for lk in collection._lookups]
        self.embedding_bags = nn.ModuleDict({
            t.name: (ShardedDynamicEmbeddingBag(_dynamic_table_module(collection, i), group, device)
                     if t.dynamic is not None else
                     ShardedEmbeddingBag(_table_module(collection, i), shardings[t.name], group, device))
            for i, t in enumerate(self.tables)})

    def forward(self, features):
        is_kjt = is_torchrec(features, "KeyedJaggedTensor")
        pooled: dict[str, torch.Tensor] = {}
        for name, (ids, offsets, psw, lookups) in self._table_inputs(features, is_kjt).items():
            out = self.embedding_bags[name](ids, offsets, psw).float()
            # [features x B, dim], features concatenated feature-major, each with the batch's B bags
            for (_, key), rows in zip(lookups, out.split([offsets.numel() // len(lookups)] * len(lookups))):
                pooled[key] = rows
        if is_kjt:
            values = torch.cat([pooled[name] for name in self.embedding_names], dim=1)
            return torchrec_type("KeyedTensor")(keys=list(self.embedding_names), length_per_key=list(self._dims),
                                                values=values)
        return pooled

    def prefetch_targets(self, features) -> list:
        """`cachedemb.prefetch` protocol: every table's input all-to-all for `features` runs now (ahead of the
        forward); returns (shard cache, ids this rank owns) per table it keeps rows of."""
        targets = []
        is_kjt = is_torchrec(features, "KeyedJaggedTensor")
        for name, (ids, offsets, psw, _) in self._table_inputs(features, is_kjt).items():
            targets += self.embedding_bags[name].prefetch_targets((ids, offsets, psw))  # dense or dynamic
        return targets

    def _table_inputs(self, features, is_kjt: bool) -> dict[str, tuple]:
        """table -> (ids of all its features concatenated feature-major, bag offsets, weights, its lookups)."""
        per_feature = self._split(features, is_kjt)
        inputs = {}
        for i, t in enumerate(self.tables):
            lookups = [(f, name) for ti, f, name in self._lookups if ti == i]
            ids, offsets, weights, start = [], [], [], 0
            for f, _ in lookups:
                values, off, w = per_feature[f]
                ids.append(values % t.num_embeddings if self.hash_ids and t.dynamic is None else values)
                offsets.append(off[:-1] + start)
                weights.append(w)
                start += values.numel()
            psw = torch.cat(weights) if weights[0] is not None else None
            inputs[t.name] = (torch.cat(ids), torch.cat(offsets), psw, lookups)
        return inputs

    def _split(self, features, is_kjt: bool) -> dict[str, tuple]:
        """feature -> (values int64, offsets with the end, per-sample weights or None)."""
        needed = {f for _, f, _ in self._lookups}
        out = {}
        if is_kjt:
            weights = features.weights_or_none()
            lengths, values = features.lengths(), features.values()
            batch = features.stride()
            ends = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)])
            for k, key in enumerate(features.keys()):
                if key not in needed:
                    continue
                lo, hi = int(ends[k * batch]), int(ends[(k + 1) * batch])
                offsets = ends[k * batch:(k + 1) * batch + 1] - lo
                out[key] = (values[lo:hi].to(torch.int64), offsets,
                            weights[lo:hi] if weights is not None else None)
        elif torch.is_tensor(features):
            if features.dim() != 2 or features.shape[1] != len(self.feature_names):
                raise ValueError(f"a tensor input must be [B, {len(self.feature_names)}] (one id per sample and "
                                 f"feature, columns {self.feature_names}), got shape {tuple(features.shape)}")
            offsets = torch.arange(features.shape[0] + 1, dtype=torch.int64, device=features.device)
            for k, key in enumerate(self.feature_names):
                if key in needed:
                    out[key] = (features[:, k].to(torch.int64), offsets, None)
        else:
            for key, value in features.items():
                if key in needed:
                    values, offsets = value[0], value[1]
                    w = value[2] if len(value) > 2 else None
                    out[key] = (values.to(torch.int64), offsets.to(torch.int64), w)
        missing = sorted(needed - set(out))
        if missing:
            raise KeyError(f"features {missing} are missing from the input (every table's features are needed)")
        return out

    @property
    def bags(self) -> list[CachedEmbeddingBag]:
        """This rank's local shard modules (their fused optimizers, e.g. to change the learning rate)."""
        return [bag.shard for bag in self.embedding_bags.values() if bag.shard is not None]

    def cache_stats(self) -> dict:
        """This rank's cache counters (CachedEmbeddingBag.cache_stats, nested `seconds` too) summed over the shards
        it keeps, `hit_rate` from the sums (reduce the counters across ranks for the job's)."""
        return sum_stats([bag.shard.cache_stats() for bag in self.embedding_bags.values() if bag.shard is not None])

    def reset_cache_stats(self) -> None:
        for bag in self.embedding_bags.values():
            if bag.shard is not None:
                bag.shard.reset_cache_stats()

    def close(self) -> None:
        """Commit and close this rank's table files (tables on file); nothing for tables in memory."""
        for bag in self.embedding_bags.values():
            if getattr(bag, "on_file", False) and bag.shard is not None:
                bag.shard.close()

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {m.sharding.describe()}" for name, m in self.embedding_bags.items())
