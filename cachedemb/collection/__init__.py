"""torchrec's EmbeddingBagCollection over cached tables: `CachedEmbeddingBagCollection` and `TableConfig`.

Owns the collection (tables grouped by dim, pooling and dtype, one CachedEmbeddingBag per group), its inputs
(KeyedJaggedTensor, dict, dense), its per-table cache rows (`cache_budget`: `cache_rows={...}` / "auto", sized
by `cachedemb.sizing`), and its capture glue (fx node, export custom op, TorchScript refusal).
torchrec is optional: it is imported only when a torchrec object comes in or goes out.

May import: `cachedemb.modules`, `cachedemb.dynamic`, `cachedemb.storage` (tables on file), `cachedemb.cache`,
`cachedemb.optim`, `cachedemb.sizing`.
"""
