"""Raw 64-bit ids: `DynamicEmbeddingBag` and `DynamicIds`, an exact id -> row index in front of the cache.

Owns the raw-id module (admission, ttl and full-slab eviction, keyed state_dict), its host index (`index`), the
`torch.export`-able keyed lookup (`keyed`) and the dict reference the tests compare against (`naive`).

May import: `cachedemb.modules`, `cachedemb.cache`, `cachedemb.optim`. `DynamicEmbeddingBag` registers itself in
`cachedemb.modules.factory`, so `CachedEmbeddingBag(None, dim, dynamic=...)` builds it.
"""
