"""Tables larger than host memory: a file on local disk as the third tier (device cache -> host cache -> file).

Owns the table file's format (`format`), its batched, copy-on-write I/O and atomic snapshots (`table_file`), the
bounded host cache of rows in front of the device cache (`host_cache`), and the file-backed module
`FileBackedEmbeddingBag` with its `FileStorage` settings (`embedding_bag`). See docs/storage.md.

May import: `cachedemb.modules`, `cachedemb.cache`, `cachedemb.optim`, `cachedemb.kernels` (the id index),
`cachedemb.sizing` (`parse_bytes`, for `FileStorage(host_cache_bytes="64GiB")`).
`FileBackedEmbeddingBag` registers itself in `cachedemb.modules.factory`, so
`CachedEmbeddingBag(..., storage=FileStorage(...))` builds it.
"""
