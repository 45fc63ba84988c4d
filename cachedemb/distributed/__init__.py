"""cachedemb.distributed: torchrun model-parallel sharding of cached embedding tables over torch.distributed.

    model = shard(model)                      # every rank, same seeded model; plan printable: print(model.plan)
    out = model(batch)                        # each rank its own local batch (any size, empty too)
    loss.backward()                           # fused optimizers update rows on their owners
    full = gather_full_state_dict(model)      # rank 0: the unsharded state_dict (export)

May import: every layer below (`cachedemb.collection`, `cachedemb.dynamic`, `cachedemb.storage` (tables on file:
`files`), `cachedemb.modules`, `cachedemb.cache`,
`materialize`); nothing else in cachedemb imports this package (only the recipes and tools above it do).
"""
from cachedemb.distributed.exchange import STATS as exchange_stats
from cachedemb.distributed.model_parallel import (
    DistributedModelParallel,
    gather_full_state_dict,
    load_full_state_dict,
    plan_for,
    shard,
)
from cachedemb.distributed.plan import ShardingPlan, ShardingType, TableSharding, default_plan
from cachedemb.distributed.bag import ShardedEmbeddingBag

__all__ = ["DistributedModelParallel", "ShardedEmbeddingBag", "ShardingPlan", "ShardingType", "TableSharding",
           "default_plan", "exchange_stats", "gather_full_state_dict", "load_full_state_dict", "plan_for", "shard"]
