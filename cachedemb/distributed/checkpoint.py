"""Checkpoints of a sharded model with torch.distributed.checkpoint (DCP), loadable at another world size or plan.

Each rank writes only the rows it keeps: a table's `weight` and `optimizer.<state>` are ShardedTensors whose
shard is the rank's row range [start, end) of the global [rows, ...] tensor (a data-parallel table is written
once, by rank 0). DCP stores the global shapes and chunk offsets, so a load asks, per rank, for the rows that
rank keeps under the *current* plan and DCP reads them from whichever chunks hold them (resharding); a
data-parallel replica reads the whole tensor. Keys are the unsharded model's state_dict keys, so a
single-process model loads the same checkpoint (`load_into_unsharded`). Nothing is pickled but the plan, which
rank 0 writes beside the checkpoint as JSON (`plan.json`).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from cachedemb.distributed.model_parallel import DistributedModelParallel, _sharded_state_names, _under
from cachedemb.distributed.plan import ShardingPlan

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
    return state, sharded


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
    dcp.load(state, checkpoint_id=path, process_group=getattr(model, "group", None))
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    dense = {k: v for k, v in state.items() if not _under(k, list(sharded))}
    inner.load_state_dict(dense, strict=False)
    for path_, m in sharded.items():
        step = state.get((f"{path_}." if path_ else "") + "optimizer.step")
        m.after_load(int(step) if step is not None else None)


def load_plan(path: str) -> ShardingPlan:
    with open(os.path.join(path, PLAN_FILE)) as f:
        return ShardingPlan.from_dict(json.load(f))


def load_into_unsharded(model: nn.Module, path: str) -> None:
    """Load a sharded checkpoint into a single-process model (cached modules unsharded): no process group."""
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state)
