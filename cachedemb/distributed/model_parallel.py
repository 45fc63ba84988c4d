"""shard(model): the torchrun entry point, and gather_full_state_dict(model) for export.

`shard` walks the model, replaces every CachedEmbeddingBag by a ShardedEmbeddingBag (its rows placed by the
plan) and wraps the rest in DistributedDataParallel on a process group of its own (so DDP's gradient
all-reduces never interleave with the embedding exchanges), ignoring the sharded modules' parameters, as
torchrec's DistributedModelParallel does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection
from cachedemb.distributed.plan import ShardingPlan, TableSharding, default_plan
from cachedemb.distributed.bag import ShardedEmbeddingBag, exchanges_cuda, rank_cuda_device
from cachedemb.distributed.collection import ShardedEmbeddingBagCollection
from cachedemb.distributed.dynamic import gather_dynamic_state_dict, shard_dynamic_tables
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.materialize import is_under as _under
from cachedemb.storage.embedding_bag import FileBackedEmbeddingBag
from cachedemb.materialize import materialize_dense, meta_walk


class DistributedModelParallel(nn.Module):
    """What `shard` returns: `module` is the model with its cached tables sharded; forward runs it (through
    DDP when it has dense parameters); `plan` says where each table lives."""

    def __init__(self, module: nn.Module, plan: ShardingPlan, group, dense_group):
        super().__init__()
        self.module = module
        self.plan = plan
        self.group = group
        ignore = [name for name, _ in _sharded_state_names(module)]
        dense = [p for n, p in module.named_parameters() if p.requires_grad and not _under(n, ignore)]
        if dense:
            module._ddp_params_and_buffers_to_ignore = [n for n, _ in list(module.named_parameters())
                                                        + list(module.named_buffers()) if _under(n, ignore)]
            self._ddp = [nn.parallel.DistributedDataParallel(module, process_group=dense_group)]
        else:
            self._ddp = []  # a list: not a submodule, so state_dict keys stay the model's

    def forward(self, *args, **kwargs):
        return (self._ddp[0] if self._ddp else self.module)(*args, **kwargs)

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """DistributedDataParallel reads this first thing in its constructor: refuse to be wrapped (DDP would
        broadcast rank 0's parameters and all-reduce per-rank shard gradients as if they were replicas)."""
        raise TypeError("DistributedDataParallel around a sharded model: shard() already wraps the dense part "
                        "in DDP (model.module's dense parameters) and keeps the cached tables model-parallel; "
                        "use the model shard() returned as it is")

    def sharded_modules(self) -> dict[str, ShardedEmbeddingBag]:
        return dict(_sharded_state_names(self.module))

    # `cachedemb.prefetch(batches, [model])` on a sharded model: reading a batch ahead runs its input
    # all-to-all (each rank's horizon and windows see the ids it owns); the batch's forward uses it.
    def prefetch_targets(self, batch) -> list:
        if not hasattr(self.module, "prefetch_targets"):
            raise TypeError(f"{type(self.module).__name__} has no prefetch_targets(batch): define it to hand "
                            "each batch's sparse input to its sharded tables' prefetch_targets")
        return list(self.module.prefetch_targets(batch))

    def on_prefetch_yield(self) -> None:
        for m in _sharded_state_names(self.module):
            m[1].on_prefetch_yield()

    def on_prefetch_end(self) -> None:
        for m in _sharded_state_names(self.module):
            m[1].on_prefetch_end()


def _sharded_state_names(module: nn.Module):
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ShardedEmbeddingBag)]


def _cached_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> CachedEmbeddingBag or CachedEmbeddingBagCollection (not the collections' own group bags)."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, (CachedEmbeddingBag, CachedEmbeddingBagCollection)) and not _under(name, list(found)):
            found[name] = m
    return found


def _table_key(path: str, table: str) -> str:
    return f"{path}.{table}" if path else table


def _tables(modules: dict[str, nn.Module]) -> dict[str, tuple[int, int, int, float]]:
    """Plan key -> (rows, dim, bytes per element, expected lookups per step or 0)."""
    specs = {}
    for name, m in modules.items():
        if isinstance(m, CachedEmbeddingBagCollection):
            for t in m.tables:  # dynamic (raw-id) tables: each id's owner is a hash of it, not a plan entry
                if t.dynamic is None:
                    specs[_table_key(name, t.name)] = (t.num_embeddings, t.embedding_dim, t.dtype.itemsize, 0.0)
        elif m.is_meta:
            specs[name] = (m.num_embeddings, m.embedding_dim, m.cache.dtype.itemsize, m.cache.expected_lookups())
        else:
            cache = m.cache
            lookups = float(cache.host_freq.sum()) / max(1, cache.train_batches)
            specs[name] = (m.num_embeddings, m.embedding_dim, cache.host_weight.element_size(), lookups)
    return specs


def _replace(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    if path == "":
        return new
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, new)
    return model


def plan_for(model: nn.Module, world_size: int) -> ShardingPlan:
    """The default plan for `model` at `world_size` (see cachedemb.distributed.plan.default_plan)."""
    return default_plan(_tables(_cached_modules(model)), world_size)


def shard(model: nn.Module, plan: ShardingPlan | dict | None = None, process_group=None) -> DistributedModelParallel:
    """Shard every CachedEmbeddingBag of `model` over the ranks of `process_group` (default: the world) and
    wrap the dense rest in DDP. Called by every rank with the same model (same values: seed it the same way);
    each rank keeps its shard of each table's current rows and optimizer state, then drops the rest.
    A model built on the meta device is allocated here, in module order, with the values one process would
    draw for it (`cachedemb.materialize(model)`): each rank allocates only its rows of each table.
    `plan`: a ShardingPlan, its `to_dict()`, or a dict {module path: TableSharding}; default `plan_for`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("cachedemb.distributed.shard needs torch.distributed initialized "
                           "(torch.distributed.init_process_group, as torchrun jobs do)")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("shard() the plain model, not a DistributedDataParallel around it: shard() wraps the "
                        "dense part in DDP itself (DDP would not see the cached tables' rows)")
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    meta_dense = {path: m for path, m, cached in meta_walk(model) if not cached}  # refuses before any change
    _refuse_built_files(model)
    model = shard_dynamic_tables(model, group)  # DynamicEmbeddingBags: ids hashed to owner ranks
    modules = _cached_modules(model)
    if plan is None:
        plan = plan_for(model, world)
    elif isinstance(plan, dict) and "world_size" in plan:
        plan = ShardingPlan.from_dict(plan)
    elif isinstance(plan, dict):
        plan = ShardingPlan(world, dict(plan))
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, its to_dict(), or None, got {type(plan).__name__}")
    if plan.world_size != world:
        raise ValueError(f"the plan is for {plan.world_size} ranks, the process group has {world}")
    tables = _tables(modules)
    missing = sorted(set(tables) - set(plan.tables))
    if missing:
        raise ValueError(f"the plan places no table for {missing}; plan: {sorted(plan.tables)}")
    extra = sorted(set(plan.tables) - set(tables))
    if extra:
        raise ValueError(f"the plan names {extra}, which are not cached tables of the model (found {sorted(tables)})")
    device = _local_device(modules, group)
    # Module order (as materialize()): meta tables and meta dense modules draw their values in turn.
    for path, m in list(model.named_modules()):
        if path in meta_dense:
            materialize_dense(m, device or torch.device("cpu"))
        if path not in modules:
            continue
        if isinstance(m, CachedEmbeddingBagCollection):
            shardings = {t.name: plan.tables[_table_key(path, t.name)] for t in m.tables if t.dynamic is None}
            model = _replace(model, path, ShardedEmbeddingBagCollection(m, shardings, group, device))
        else:
            model = _replace(model, path, ShardedEmbeddingBag(m, plan.tables[path], group, device))
    ranks = dist.get_process_group_ranks(group) if group is not dist.group.WORLD else list(range(world))
    dense_group = dist.new_group(ranks, use_local_synchronization=True)  # only the group's ranks call shard()
    return DistributedModelParallel(model, plan, group, dense_group)


def _refuse_built_files(model: nn.Module) -> None:
    """Tables on file are sharded from the meta device (each rank creates the file of its rows): a table whose
    files were already built holds the whole table in one file per process."""
    for name, m in model.named_modules():
        built = isinstance(m, FileBackedEmbeddingBag) or (isinstance(m, CachedEmbeddingBagCollection)
                                                          and m.storage is not None and m.bags)
        if built:
            raise ValueError(f"{name or '<model>'}: a table on file is sharded from the meta device: build it with "
                             "device='meta' and storage=FileStorage(...) (shard() then creates each rank's file "
                             "of its rows, <stem>.rank<r>of<w>.cemb); this one already holds whole-table files")


def _local_device(modules, group) -> torch.device | None:
    """Each rank's cache on its own GPU (LOCAL_RANK), when the modules' caches were on CUDA, or were built on
    meta and the group exchanges CUDA tensors (NCCL; a gloo job keeps them in host memory)."""
    caches = [b.cache for m in modules.values() for b in (m.bags if isinstance(m, CachedEmbeddingBagCollection)
                                                          else [m])]
    meta = any(isinstance(m, CachedEmbeddingBagCollection) and not m.bags for m in modules.values())
    if any(c.device.type == "cuda" for c in caches) or (torch.cuda.is_available() and exchanges_cuda(group) and (
            meta or any(c.device.type == "meta" for c in caches))):
        return rank_cuda_device()
    return None


def gather_full_state_dict(model: nn.Module, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The unsharded state_dict (keys as the model before `shard`), on rank `dst`; None on other ranks.
    Collective: every rank must call it. Rows travel as pickled tensors (gather_object): for export of a
    model that fits on one host."""
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    group = model.group if isinstance(model, DistributedModelParallel) else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sharded = dict(_sharded_state_names(inner))
    mine = {name: (m.row_start, m.row_end, {k: v.clone() for k, v in m.local_state().items()})
            for name, m in sharded.items()}
    gathered = [None] * world if rank == dst else None
    global_dst = dist.get_global_rank(group, dst) if group is not dist.group.WORLD else dst
    dist.gather_object(mine, gathered, dst=global_dst, group=group)
    dynamic = gather_dynamic_state_dict(inner, group, dst)  # keyed by id, merged over the ranks
    if rank != dst:
        return None
    out = {k: v for k, v in inner.state_dict().items() if not _under(k, list(sharded))}
    out.update(dynamic)
    for name, m in sharded.items():
        prefix = f"{name}." if name else ""
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            start, end, state = part[name]
            for key, value in state.items():
                if key == "optimizer.step":
                    full[key] = value
                    continue
                if key not in full:
                    full[key] = torch.empty((m.num_embeddings,) + tuple(value.shape[1:]), dtype=value.dtype)
                full[key][start:end] = value
        out.update({prefix + k: v for k, v in full.items()})
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state_dict (keys as the model before `shard`) into a sharded model: every rank
    takes its rows. Each rank must hold the full state_dict (e.g. torch.load on every rank)."""
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    sharded = dict(_sharded_state_names(inner))
    for name, m in sharded.items():
        prefix = f"{name}." if name else ""
        m.load_local_state({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
    dense = {k: v for k, v in state_dict.items() if not _under(k, list(sharded))}
    inner.load_state_dict(dense, strict=False)


__all__ = ["DistributedModelParallel", "TableSharding", "gather_full_state_dict", "load_full_state_dict",
           "plan_for", "shard"]
