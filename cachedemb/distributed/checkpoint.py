"""Checkpoints of a sharded model with torch.distributed.checkpoint (DCP), loadable at another world size or plan.

Each rank writes only the rows it keeps: a table's `weight` and `optimizer.<state>` are ShardedTensors whose
shard is the rank's row range [start, end) of the global [rows, ...] tensor (a data-parallel table is written
once, by rank 0). DCP stores the global shapes and chunk offsets, so a load asks, per rank, for the rows that
rank keeps under the *current* plan and DCP reads them from whichever chunks hold them (resharding); a
data-parallel replica reads the whole tensor. Keys are the unsharded model's state_dict keys, so a
single-process model loads the same checkpoint (`load_into_unsharded`). Nothing is pickled but the plan, which
rank 0 writes beside the checkpoint as JSON (`plan.json`).

Dynamic (raw-id) tables are keyed by id: each per-id tensor (ids, weight, optimizer state, counts, last seen;
the pending_* group alike) is saved as the concatenation of the ranks' parts, rank r's part at the offset of
the ranks before it; a load reads every part (any world size, or one process) and each rank keeps the ids it
owns now.
"""
from __future__ import annotations

import inspect
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from cachedemb.collection.embedding_bag_collection import CachedEmbeddingBagCollection, _DynamicGroupBag
from cachedemb.distributed.model_parallel import DistributedModelParallel, _sharded_state_names, _under
from cachedemb.distributed.plan import ShardingPlan
from cachedemb.distributed.dynamic import ShardedDynamicEmbeddingBag, _sharded_dynamic, id_group
from cachedemb.dynamic.embedding_bag import DynamicEmbeddingBag

PLAN_FILE = "plan.json"


def _state(model: nn.Module, for_load: bool) -> tuple[dict, dict]:
    """The DCP state dict (tensors alias the live host rows) and {path: module} of the sharded tables."""
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    group = model.group if isinstance(model, DistributedModelParallel) else dist.group.WORLD
    sharded = dict(_sharded_state_names(inner))
    state = {k: v for k, v in inner.state_dict().items() if not _under(k, list(sharded))}
    for path, m in sharded.items():
        prefix = f"{path}." if path else ""
        local = m.local_state()
        for key in m.state_keys():
            if key == "optimizer.step":
                if "optimizer.step" in local:
                    state[prefix + key] = local[key]
                continue
            value = local.get(key)
            if m.data_parallel and for_load:
                state[prefix + key] = value  # a replica reads the whole tensor
                continue
            keep = value is not None and not (m.data_parallel and m.rank != 0)
            cols = m.state_columns(key)
            shape = (m.num_embeddings,) + ((cols,) if cols else ())
            shards = []
            if keep:
                md = ShardMetadata(shard_offsets=[m.row_start] + [0] * (len(shape) - 1),
                                   shard_sizes=list(value.shape), placement=f"rank:{dist.get_rank()}/cpu")
                shards.append(Shard(value, md))
            state[prefix + key] = ShardedTensor._init_from_local_shards(shards, *shape, process_group=group)
    state.update(_dynamic_state(inner, group, for_load))
    return state, sharded


def _dynamic_state(inner: nn.Module, group, for_load: bool) -> dict:
    """DCP entries of the sharded dynamic tables: per-id tensors as the concatenation of the ranks' parts (on
    load: placeholders, sized from the checkpoint by `_size_dynamic_entries`), steps replicated."""
    state = {}
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for path, m in _sharded_dynamic(inner).items():
        prefix = f"{path}." if path else ""
        local = m.shard.state_dict()
        if for_load:
            state.update({prefix + key: value for key, value in local.items()})
            continue
        lengths = torch.tensor([[local["ids"].numel(), local["pending_ids"].numel()]], dtype=torch.int64)
        every = [torch.zeros_like(lengths) for _ in range(world)]
        dist.all_gather(every, lengths, group=group)
        every = torch.cat(every)
        for key, value in local.items():
            group_of = id_group(key)
            if group_of is None:
                state[prefix + key] = value
                continue
            column = ("ids", "pending_ids").index(group_of)
            total, offset = int(every[:, column].sum()), int(every[:rank, column].sum())
            if total == 0:
                state[prefix + key] = value  # empty everywhere: one plain (replicated) empty tensor
                continue
            shards = []
            if value.shape[0] > 0:
                md = ShardMetadata(shard_offsets=[offset] + [0] * (value.dim() - 1), shard_sizes=list(value.shape),
                                   placement=f"rank:{dist.get_rank()}/cpu")
                shards.append(Shard(value.contiguous(), md))
            state[prefix + key] = ShardedTensor._init_from_local_shards(shards, total, *value.shape[1:],
                                                                        process_group=group)
    return state


def _dynamic_prefixes(model: nn.Module) -> list[str]:
    """Key prefixes of the id-keyed states of `model`'s dynamic tables (sharded or not, alone or in a
    collection)."""
    out = []
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, ShardedDynamicEmbeddingBag) or (isinstance(m, DynamicEmbeddingBag)
                                                         and not isinstance(m, _DynamicGroupBag)):
            out.append(prefix)  # (a collection's group bag saves nothing: its table view does, below)
        elif isinstance(m, CachedEmbeddingBagCollection):
            out += [f"{prefix}embedding_bags.{t.name}." for t in m.tables if t.dynamic is not None]
    return out


def _size_dynamic_entries(state: dict, model: nn.Module, path: str) -> None:
    """Per-id entries of dynamic tables become empty tensors of the saved (concatenated) length, so DCP reads
    every rank's part whatever this model holds now."""
    prefixes = _dynamic_prefixes(model)
    if not prefixes:
        return
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, value in list(state.items()):
        owner = max((p for p in prefixes if key.startswith(p)), key=len, default=None)
        if owner is not None and id_group(key[len(owner):]) is not None:
            if key not in saved:
                raise KeyError(f"{key} is not in the checkpoint at {path}")
            state[key] = torch.empty(tuple(saved[key].size), dtype=value.dtype)


def _sort_dynamic_entries(state: dict, model: nn.Module) -> None:
    """The concatenated parts in id order (as one process's state_dict), per id group."""
    for prefix in _dynamic_prefixes(model):
        for ids_key in ("ids", "pending_ids"):
            if prefix + ids_key not in state:
                continue
            order = torch.argsort(state[prefix + ids_key])
            for key in [k for k in state if k.startswith(prefix)]:
                if id_group(key[len(prefix):]) == ids_key:
                    state[key] = state[key][order]


def save_checkpoint(model: nn.Module, path: str) -> None:
    """Every rank writes its rows under `path` (a directory); rank 0 also writes the plan as JSON."""
    state, _ = _state(model, for_load=False)
    dcp.save(state, checkpoint_id=path, process_group=getattr(model, "group", None))
    if dist.get_rank() == 0 and isinstance(model, DistributedModelParallel):
        with open(os.path.join(path, PLAN_FILE), "w") as f:
            json.dump(model.plan.to_dict(), f, indent=1)


def load_checkpoint(model: nn.Module, path: str) -> None:
    """Every rank reads the rows its current plan gives it (any world size or plan at save time)."""
    state, sharded = _state(model, for_load=True)
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    _size_dynamic_entries(state, inner, path)
    dcp.load(state, checkpoint_id=path, process_group=getattr(model, "group", None))
    _sort_dynamic_entries(state, inner)
    dense = {k: v for k, v in state.items() if not _under(k, list(sharded))}
    inner.load_state_dict(dense, strict=False)
    for path_, m in sharded.items():
        step = state.get((f"{path_}." if path_ else "") + "optimizer.step")
        m.after_load(int(step) if step is not None else None)


def load_plan(path: str) -> ShardingPlan:
    with open(os.path.join(path, PLAN_FILE)) as f:
        return ShardingPlan.from_dict(json.load(f))


def _load_in_this_process(state: dict, path: str) -> None:
    """dcp.load by this process alone, a process group or not. torch < 2.6's dcp.load has no `no_dist` (it infers
    it from whether a process group exists); its load_state_dict takes it."""
    if "no_dist" in inspect.signature(dcp.load).parameters:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    else:
        dcp.load_state_dict(state, dcp.FileSystemReader(path), no_dist=True)


def load_into_unsharded(model: nn.Module, path: str) -> None:
    """Load a sharded checkpoint into a single-process model (cached modules unsharded): no process group."""
    state = model.state_dict()
    _size_dynamic_entries(state, model, path)
    _load_in_this_process(state, path)
    _sort_dynamic_entries(state, model)
    model.load_state_dict(state)
