"""Tables built on the meta device: what a cached module keeps until it is materialized, and the replay of
its initialization over a range of rows.

A seeded job that builds its model on `meta` and shards it must start from the rows one process would have
drawn (`materialize(model)`), whatever the world size and plan. Each rank therefore replays the whole table's
random stream in fixed chunks (memory O(chunk), time O(table)) and keeps only its rows; every rank's generator
ends where one process's would, so the draws after it (dense layers, the next table) agree too.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Chunks of the flattened table: CPU normal_ fills blocks of 16 elements (a shorter tail is redrawn), so
# chunk boundaries at multiples of 16 from the table's start draw exactly what one whole-table fill draws.
CHUNK_ELEMENTS = 1 << 22
_BLOCK = 16


@dataclass(frozen=True)
class TableInit:
    """How a table's rows are first filled. `elementwise`: `fill` draws one stream in element order, so the
    flattened table filled chunk by chunk equals one fill of the whole (normal_, uniform_); otherwise (any
    user init_fn) the replay fills a whole-table scratch tensor once."""

    fill: Callable[[torch.Tensor], object]
    elementwise: bool
    padding_idx: int | None = None

    @staticmethod
    def normal(padding_idx: int | None = None) -> "TableInit":
        """nn.EmbeddingBag's init: N(0, 1), the padding row zeroed."""
        return TableInit(torch.Tensor.normal_, True, padding_idx)

    @staticmethod
    def uniform(num_rows: int) -> "TableInit":
        """torchrec's default table init: U(-sqrt(1/rows), sqrt(1/rows))."""
        bound = math.sqrt(1.0 / num_rows)
        return TableInit(lambda t: t.uniform_(-bound, bound), True)


@dataclass
class MetaTable:
    """A CachedEmbeddingBag's storage before materialization (it stands where the cache will be): the table's
    shape, dtype and cache settings, no memory. Anything that needs rows raises a clear error."""

    num_rows: int
    dim: int
    dtype: torch.dtype
    capacity: int
    policy: object
    id_freq: torch.Tensor | None
    history: int
    freq_halflife: int | None
    warmup_ratio: float
    init: TableInit

    device = torch.device("meta")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(
            f"this CachedEmbeddingBag is on the meta device: it has no table or cache yet (asked for {name!r}). "
            "Materialize it with `module.to_empty(device=...)` then `module.reset_parameters()`, with "
            "`cachedemb.materialize(model)`, or shard it with `cachedemb.distributed.shard(model)`")

    def expected_lookups(self) -> float:
        return float(self.id_freq.sum()) if self.id_freq is not None else 0.0


def probe_apply(fn, dtype: torch.dtype, device) -> torch.Tensor:
    """What `fn` (an nn.Module._apply function) makes of a tensor of `dtype` on `device`: the device and dtype
    a module is being moved / converted to. `.to(device)` refuses to copy out of meta: probed on CPU then."""
    try:
        return fn(torch.zeros(1, dtype=dtype, device=device))
    except NotImplementedError:
        return fn(torch.zeros(1, dtype=dtype, device="cpu"))


def init_rows(init: TableInit, num_rows: int, dim: int, dtype: torch.dtype, start: int, end: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, end) of a [num_rows, dim] table filled by `init` from the current RNG state, drawing the
    whole table's stream (so the generator ends as after filling the whole table). `start == end` only
    advances the generator. `out` (end - start rows) receives the rows when given."""
    if not 0 <= start <= end <= num_rows:
        raise ValueError(f"row range [{start}, {end}) is not inside a table of {num_rows} rows")
    if out is None:
        out = torch.empty((end - start, dim), dtype=dtype)
    if not init.elementwise:
        full = torch.zeros((num_rows, dim), dtype=dtype)
        with torch.no_grad():
            init.fill(full)
        out.copy_(full[start:end])
    else:
        _replay_elementwise(init, num_rows * dim, dtype, start * dim, end * dim, out.view(-1))
    if init.padding_idx is not None and start <= init.padding_idx < end:
        out[init.padding_idx - start].zero_()
    return out


def iter_init_chunks(init: TableInit, total: int, dtype: torch.dtype, chunk: int = CHUNK_ELEMENTS // 16):
    """An elementwise init of a flattened table of `total` elements, drawn chunk by chunk exactly as one
    whole-table fill draws it (memory O(chunk); `chunk` a multiple of 16): for tables streamed to a file."""
    if chunk % _BLOCK:
        raise ValueError(f"init chunks must be a multiple of {_BLOCK} elements, got {chunk}")
    i = 0
    with torch.no_grad():
        while i < total:
            j = min(total, i + chunk)
            if total - j < _BLOCK:
                j = total
            buf = torch.empty(j - i, dtype=dtype)
            init.fill(buf)
            yield buf
            i = j


def _replay_elementwise(init: TableInit, total: int, dtype, lo: int, hi: int, flat_out: torch.Tensor) -> None:
    scratch = None
    i = 0
    with torch.no_grad():
        while i < total:
            j = min(total, i + CHUNK_ELEMENTS)
            if total - j < _BLOCK:
                j = total  # a tail shorter than a block joins this chunk (as in one whole-table fill)
            if lo <= i and j <= hi:
                init.fill(flat_out[i - lo:j - lo])
            else:
                if scratch is None:
                    scratch = torch.empty(CHUNK_ELEMENTS + _BLOCK, dtype=dtype)
                buf = scratch[:j - i]
                init.fill(buf)
                a, b = max(i, lo), min(j, hi)
                if a < b:
                    flat_out[a - lo:b - lo].copy_(buf[a - i:b - i])
            i = j


__all__ = ["CHUNK_ELEMENTS", "MetaTable", "TableInit", "init_rows", "iter_init_chunks", "probe_apply"]
