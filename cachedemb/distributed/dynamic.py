"""ShardedDynamicEmbeddingBag: a DynamicEmbeddingBag (raw int64 ids) over the ranks, each id owned by one rank.

The owner of an id is `owner_rank(id, W) = (mix64(id ^ K) >>> 1) mod W` (splitmix64's finalizer with a key of
its own, so owners do not correlate with the IdIndex's home slots): a function of the id and W only. Each rank
keeps a DynamicEmbeddingBag of its own (`self.shard`) for the ids it owns, with `ceil(capacity / W)` rows
(and `ceil(in_flight_rows / W)` spare rows, `ceil(cache rows / W)` cache rows).

One forward (every rank, its own local batch, possibly empty), as ShardedEmbeddingBag's row-wise path::

    input, offsets ──normalize──> raw ids, bag of each lookup (padding_idx lookups dropped)
        ├─ exchange_counts [counts, bags]; all_to_all raw ids + bag; AllToAllRows per-sample weights
        v
    owner: its DynamicEmbeddingBag over the bags of all sources (count, admit, evict, pool "sum" / "max")
        │  AllToAllRows back: B_r partial rows to rank r       (ShardedEmbeddingBag.compute / _finish)
        v
    combine per bag over owners: sum; mean = sum / lookups; max over the owners that saw a lookup (else 0)

Backward mirrors it; each owner's fused optimizer updates its rows, and every owner runs one training forward
(and one optimizer step) per global step, so `step`, `last_seen` and the optimizer step equal the single
process's. Because a new row is `initial_rows(seed, id)` and counting, admission, ttl and eviction are per id,
training equals one DynamicEmbeddingBag trained on the concatenation of the ranks' batches (rank order), up to
the float order of the pooled sums, while no rank's capacity is exceeded; capacity eviction is then per rank
(each rank evicts among its own ids, bounded by its own capacity).

State: `state_dict()` is this rank's part, keyed by id as DynamicEmbeddingBag's; `load_state_dict` takes a
full (unsharded) or partial keyed state and keeps the ids this rank owns; `gather_dynamic_state_dict` (called
by gather_full_state_dict) merges the ranks' parts into the single-process module's state_dict.
Under `cachedemb.prefetch`, reading a batch ahead runs its raw-id exchange, and the owner's DynamicEmbeddingBag
reads the ids it received ahead (counting, admission and eviction happen then, as in one process); the batch's
training forward takes the queued exchange (checked to be its batch's), so training equals training without
prefetch.
A CachedEmbeddingBagCollection's dynamic tables become ShardedDynamicEmbeddingBags inside its
ShardedEmbeddingBagCollection (same owners, same state keys). Not supported (refused): unadmitted="shared" (one
shared row would need an all-reduce).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection
from cachedemb.distributed.exchange import AllToAllRows, all_to_all, exchange_counts
from cachedemb.distributed.bag import ExchangedInput, ShardedEmbeddingBag, lookups_with_bags, rank_cuda_device
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag
from cachedemb.dynamic.index import _i64, _lsr, mix64
from cachedemb.modules.batch_input import batch_input_args
from cachedemb.modules.input_check import normalize_bag_input

_OWNER_KEY = _i64(0xD6E8FEB86659FD93)
_STEP_KEYS = ("step", "optimizer.step")


def id_group(key: str) -> str | None:
    """Which id list a DynamicEmbeddingBag state entry runs along: "ids" (admitted ids: weight, optimizer
    state, counts, last seen), "pending_ids" (the pending_* entries), or None (steps, the unadmitted row)."""
    if key in _STEP_KEYS or key.startswith("unadmitted."):
        return None
    return "pending_ids" if key.startswith("pending_") else "ids"


def owner_rank(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that owns each raw int64 id: (mix64(id ^ K) >>> 1) mod world_size."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return _lsr(mix64(ids.to(torch.int64) ^ _OWNER_KEY), 1) % world_size


def _same(a, b) -> bool:
    """The forward's argument is the one read ahead: the same tensor, or equal (shape; values when on the host,
    so no device sync)."""
    if a is b:
        return True
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
        return False
    return a.device.type != "cpu" or b.device.type != "cpu" or torch.equal(a, b)


def _split_keyed(state: dict, prefix: str, keep_ids, keep_pending) -> dict:
    """The entries of a DynamicEmbeddingBag keyed state (keys under `prefix`) for the ids kept."""
    out = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name in _STEP_KEYS or name.startswith("unadmitted."):
            out[key] = value
        elif name.startswith("pending_"):
            out[key] = value[keep_pending(state[prefix + "pending_ids"])]
        else:
            out[key] = value[keep_ids(state[prefix + "ids"])]
    return out


class ShardedDynamicEmbeddingBag(nn.Module):
    """The sharded equivalent of a DynamicEmbeddingBag: same forward signature and outputs; this rank keeps
    the ids `owner_rank(id, W) == rank` in `self.shard` (a DynamicEmbeddingBag, not a child module: the
    state_dict is keyed by id, as the unsharded module's)."""

    # prefetch_targets(batch) takes the batch's input by position (modules/batch_input.py): cachedemb.prefetch
    # refuses a default extraction shared by several such modules.
    reads_batch_by_position = True

    data_parallel = False
    # The owner-side lookup, the return all-to-all and the per-bag combine are the row-wise path's.
    compute = ShardedEmbeddingBag.compute
    _finish = ShardedEmbeddingBag._finish

    def __init__(self, module: DynamicEmbeddingBag, group=None, device=None):
        super().__init__()
        if not isinstance(module, DynamicEmbeddingBag):
            raise TypeError(f"ShardedDynamicEmbeddingBag shards a DynamicEmbeddingBag, got {type(module).__name__}")
        cfg = module.config
        if cfg.unadmitted != "zero":
            raise NotImplementedError(
                f"shard() of a dynamic table with unadmitted={cfg.unadmitted!r}: the shared unadmitted row would be "
                "trained on every rank (it needs an all-reduce, not supported); use unadmitted='zero'")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        world = self.world_size
        self.owners = list(range(world))
        self.embedding_dim, self.mode, self.padding_idx = module.embedding_dim, module.mode, module.padding_idx
        inner = module.inner
        self.include_last_offset, self.optimizer = inner.include_last_offset, module.optimizer
        self.dtype = module.cache.dtype
        self.config = cfg
        in_flight = module.row_ids.numel() - cfg.capacity
        local_cfg = replace(cfg, capacity=math.ceil(cfg.capacity / world))
        shard = DynamicEmbeddingBag(
            None, module.embedding_dim, max_norm=inner.max_norm, norm_type=inner.norm_type,
            scale_grad_by_freq=inner.scale_grad_by_freq, mode="max" if self.mode == "max" else "sum",
            sparse=inner.sparse, include_last_offset=True, padding_idx=None, device=device or module.cache.device,
            dtype=self.dtype, dynamic=local_cfg, optimizer=module.optimizer,
            cache_rows=max(1, math.ceil(module.cache.capacity / world)), in_flight_rows=math.ceil(in_flight / world),
            validate_inputs=False)
        object.__setattr__(self, "shard", shard)
        shard.inner._shard_local = True  # this rank's part: not an unsharded copy in a multi-process job
        # The module's current ids (admitted and counting), rows and state: this rank keeps the ids it owns.
        state = module.state_dict()
        shard.load_state_dict(self._owned(state, ""))
        shard.train(module.training)
        self.training = module.training
        self._prefetched: deque = deque()  # [loop, (input, offsets, weights), ExchangedInput] read ahead

    def _owned(self, state: dict, prefix: str) -> dict:
        mine = lambda ids: owner_rank(ids, self.world_size) == self.rank  # noqa: E731
        return _split_keyed(state, prefix, mine, mine)

    # ----------------------------------------------------------------- forward
    def forward(self, input, offsets=None, per_sample_weights=None):
        exchanged = self._take_prefetched(input, offsets, per_sample_weights)
        if exchanged is None:
            exchanged = self.input_dist(input, offsets, per_sample_weights)
        return self.compute(exchanged)

    def input_dist(self, input, offsets=None, per_sample_weights=None) -> ExchangedInput:
        """Raw ids to their owner ranks (collective: every rank calls it for its own batch, in the same order)."""
        if not torch.is_tensor(input) or input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must be an int64 (or int32) tensor of raw ids, got "
                            f"{input.dtype if torch.is_tensor(input) else type(input).__name__}")
        # Offsets, 2-D input, include_last_offset and per-sample weights as nn.EmbeddingBag's (the row-wise
        # path's normalization); the id range check does not apply to raw ids, so it sees zeros, and the ids
        # are the raw input's prefix it keeps.
        bags = normalize_bag_input(torch.zeros(input.shape, dtype=torch.int64, device=input.device), offsets,
                                   per_sample_weights, mode=self.mode, include_last_offset=self.include_last_offset,
                                   num_embeddings=1, device=input.device, validate=True,
                                   padding_idx=self.padding_idx, table_dtype=self.dtype)
        n_bags = bags.offsets.numel() - 1
        ids, bag_of, psw = lookups_with_bags(input.reshape(-1)[: bags.ids.numel()].to(torch.int64), bags.offsets,
                                             bags.per_sample_weights, self.padding_idx)
        world, group = self.world_size, self.group
        owner = owner_rank(ids, world)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world).tolist()
        payload = torch.stack([ids[order], bag_of[order]], 1)
        psw_send = psw[order] if psw is not None else None
        header = torch.tensor([[c, n_bags] for c in send_counts], dtype=torch.int64, device=ids.device)
        recv_header = exchange_counts(header, group).cpu()
        recv_counts, recv_bags = recv_header[:, 0].tolist(), recv_header[:, 1].tolist()
        recv = all_to_all(payload, recv_counts, send_counts, group)
        recv_psw = AllToAllRows.apply(psw_send, recv_counts, send_counts, group) if psw is not None else None
        total = sum(recv_bags)
        source = torch.repeat_interleave(torch.arange(world, dtype=torch.int64), torch.tensor(recv_counts))
        base = torch.tensor([0] + recv_bags[:-1], dtype=torch.int64).cumsum(0)
        global_bag = recv[:, 1] + base[source].to(recv.device)
        local_offsets = torch.zeros(total + 1, dtype=torch.int64, device=recv.device)
        local_offsets[1:] = torch.bincount(global_bag, minlength=total).cumsum(0)
        return ExchangedInput(input.numel(), n_bags, ids, bag_of, owner, bags.lead, bags.trail,
                              bags.last_bag_scale, recv_bags, recv[:, 0], local_offsets, recv_psw)

    # ----------------------------------------------------------------- prefetch
    def prefetch_targets(self, batch) -> list:
        """`cachedemb.prefetch` protocol (collective: every rank reads its batches ahead in the same order).
        Reading a batch ahead runs its raw-id all-to-all now; the owner's DynamicEmbeddingBag then reads the ids
        it received ahead (in training mode it counts, admits and evicts for them now, as one process does under
        prefetch) and returns its slab rows, so this rank's horizon and windows see the ids it owns. In training
        mode the exchange is queued for the batch's training forward; in eval mode it only announces rows (an
        eval forward exchanges its batch itself). `batch`: input tensor, (input, offsets[, weights]) tuple, or
        dict with "input" (and "offsets", "per_sample_weights")."""
        args = batch_input_args(batch)
        exchanged = self.input_dist(*args)
        if self.training and torch.is_grad_enabled():
            # Tagged with the loop that reads it: None while a loop fills its horizon (it owns the cache from
            # its first yield on), retagged by that loop's first training forward.
            self._prefetched.append([self._loop(), args, exchanged])
        return self.shard.prefetch_targets(exchanged.local_ids)

    def _loop(self):
        """The prefetch loop running over this rank's shard cache (None: none, or one still filling)."""
        return getattr(self.shard.cache, "prefetch_owner", None)

    def _take_prefetched(self, input, offsets, per_sample_weights) -> ExchangedInput | None:
        """A training forward inside a prefetch loop takes the oldest exchange read ahead, which must be its
        batch's. Exchanges of a loop that has ended are dropped first (the owner's read-ahead batches stay
        counted, as in one process). Every decision depends on the mode, the loops and the queue, the same on
        every rank, so the collectives stay matched. Eval forwards exchange their own batch."""
        if not (self.training and torch.is_grad_enabled()) or not self._prefetched:
            return None
        loop = self._loop()
        if loop is None:  # the loop ended (left early): nothing it read ahead is consumed
            self._prefetched.clear()
            return None
        while self._prefetched and self._prefetched[0][0] not in (None, loop):
            self._prefetched.popleft()  # read ahead by an earlier loop, left early
        for entry in self._prefetched:
            if entry[0] is None:
                entry[0] = loop
        if not self._prefetched:
            return None
        _, (q_input, q_offsets, q_psw), exchanged = self._prefetched.popleft()
        if not (_same(input, q_input) and _same(offsets, q_offsets) and _same(per_sample_weights, q_psw)):
            raise RuntimeError(
                "a training forward of a sharded dynamic table under cachedemb.prefetch got another batch than the "
                "one read ahead for it (its raw-id exchange already ran): train on the prefetched batches in "
                "order, in training mode when they are read ahead; close a prefetch loop you leave before its "
                "first forward")
        return exchanged

    # ----------------------------------------------------------------- state
    def dynamic_stats(self) -> dict[str, int]:
        """This rank's DynamicEmbeddingBag stats (its own ids; sum the ranks' counters for the table's)."""
        return self.shard.dynamic_stats()

    def evict_stale(self, ttl_steps: int | None = None) -> int:
        """This rank's ttl sweep (not collective); returns the admitted ids it evicted."""
        return self.shard.evict_stale(ttl_steps)

    def flush(self) -> None:
        self.shard.flush()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.shard._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A full (gathered) or this rank's keyed state: keeps the ids this rank owns."""
        mine = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        if prefix + "ids" in mine and prefix + "pending_ids" in mine:
            mine = self._owned(mine, prefix)
        self.shard._load_from_state_dict(mine, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                         error_msgs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.shard.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        self.shard._apply(fn)
        return self

    def extra_repr(self) -> str:
        return (f"None, {self.embedding_dim}, mode={self.mode!r}, dynamic={self.config}, ids hashed to "
                f"{self.world_size} ranks, rank {self.rank} capacity {self.shard.config.capacity}")


def _sharded_dynamic(model: nn.Module) -> dict[str, ShardedDynamicEmbeddingBag]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ShardedDynamicEmbeddingBag)}


def shard_dynamic_tables(model: nn.Module, group) -> nn.Module:
    """shard()'s step for dynamic tables: every DynamicEmbeddingBag of `model` becomes a
    ShardedDynamicEmbeddingBag over `group`; returns the model (the new module when `model` is one)."""
    # A collection's dynamic tables are sharded with the collection (ShardedEmbeddingBagCollection).
    collections = [n for n, m in model.named_modules() if isinstance(m, CachedEmbeddingBagCollection)]
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, DynamicEmbeddingBag) and not any(n.startswith(c + ".") or c == "" for c in collections)]
    for name, m in found:
        device = m.cache.device
        if device.type == "cuda":
            device = rank_cuda_device()
        new = ShardedDynamicEmbeddingBag(m, group, device)
        if name == "":
            return new
        parent_path, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, new)
    return model


def gather_dynamic_state_dict(model: nn.Module, group, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The sharded dynamic tables' keyed states merged over the ranks (keys and values as the single-process
    DynamicEmbeddingBag's state_dict), on rank `dst`; None on other ranks. Collective: every rank calls it."""
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tables = _sharded_dynamic(model)
    mine = {name: m.shard.state_dict() for name, m in tables.items()}
    gathered = [None] * world if rank == dst else None
    global_dst = dist.get_global_rank(group, dst) if group is not dist.group.WORLD else dst
    dist.gather_object(mine, gathered, dst=global_dst, group=group)
    if rank != dst:
        return None
    out: dict[str, torch.Tensor] = {}
    for name in tables:
        prefix = f"{name}." if name else ""
        parts = [part[name] for part in gathered]
        for key in _STEP_KEYS:
            values = {int(p[key]) for p in parts}
            if len(values) != 1:
                raise RuntimeError(f"{prefix}{key} differs over the ranks ({sorted(values)}): every rank must run "
                                   "every training forward of a sharded dynamic table")
            out[prefix + key] = parts[0][key].clone()
        for ids_key in ("ids", "pending_ids"):
            ids = torch.cat([p[ids_key] for p in parts])
            ids, order = torch.sort(ids)
            for key in parts[0]:
                if id_group(key) == ids_key:
                    out[prefix + key] = torch.cat([p[key] for p in parts])[order]
    return out


__all__ = ["ShardedDynamicEmbeddingBag", "gather_dynamic_state_dict", "owner_rank", "shard_dynamic_tables"]
