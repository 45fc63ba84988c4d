"""The software cache: host table behind a device cache, no nn.Module.

Owns `EmbeddingCache` (host table, optimizer state and access counts; device rows, slot metadata, the id -> slot
index; `prepare` / `admit_window` / `flush`), the eviction policies, the victim pool and its miss estimate, exact-size
pinned host memory, and the switch that runs the CUDA no-sync rules on CPU (`sync_mode`).

May import: `cachedemb.kernels` and torch. Nothing here imports an nn.Module layer above it.
"""
