"""Dynamic ids: raw int64 ids -> host rows, in front of the cache.

Data flow of one forward (host side; the cache below keeps seeing dense rows)::

    raw ids [B] int64 (any value)
      -> torch.unique                        distinct ids U, inverse, per-id lookup counts
      -> IdIndex.lookup / insert             exact index id -> entry (open addressing, bounded probes)
      -> training forwards only: count, last seen, admission at the min_count-th occurrence
         (rows from a free list of `capacity` slab rows; when full: evict by (count, last seen, id) or reject)
      -> row per lookup                      admitted row, else the unadmitted row (zero or shared), pad row
      -> CachedEmbeddingBag over the slab    [capacity + 1 (+1 pad)] rows, the device cache in front of it

Rows of the slab: [0, R) with R = capacity + in_flight_rows hold admitted ids (at most `capacity` at once) and
rows waiting to be reused; row R is the unadmitted row (reset to zero before every forward with
unadmitted="zero", trained with "shared"); row R + 1 is the padding row when `padding_idx` (a raw id) is given.

Under `cachedemb.prefetch` the remap runs in the prefetch stage: `prefetch_targets(batch)` remaps (counts,
admits, evicts) the batch when it is read ahead and queues its rows; the batch's forward takes them from the
queue (matched by value). Eviction decisions are the same as without prefetch (victims are chosen among rows
the current batch does not use, by the same keys), so training is bit-equal; what differs is when a victim's
row is reused: a row that a batch still in flight (remapped, forward/backward not done) reads is held back
(`held_rows`) until that batch is done, so capacity and ttl eviction never touch rows in flight. Held rows
come out of the `in_flight_rows` spare rows; when those run out, read-ahead remapping pauses and the forward
remaps (and catches up) instead: the result is the same either way.

A new row's value is `initial_rows(seed, id)`: a counter-based normal draw (splitmix64 + Box-Muller), so it
depends on (seed, id) only, never on arrival order, batch composition or rank. Admitting an id writes that value
and the optimizer's initial state into the host row and overwrites the row's cache slot if it is resident, so an
evicted id that returns is bit-equal to a never-seen one (`EmbeddingCache.reread_rows`).

Eval forwards (`module.eval()` or no grad) are read-only: no counting, no admission, no sweep (inside a prefetch
loop they see the admissions of the batches already read ahead).
The reference path (a Python dict remap) is `cachedemb.dynamic.naive`; the id index is `cachedemb.dynamic.index`,
the serving module `cachedemb.dynamic.keyed`.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cachedemb.cache.embedding_cache import EmbeddingCache
from cachedemb.dynamic.index import _GOLDEN, _MIX1, _MIX2, IdIndex, _i64, mix64
from cachedemb.dynamic.keyed import KeyedEmbeddingBag
from cachedemb.modules.batch_input import batch_input
from cachedemb.modules.embedding_bag import CachedEmbeddingBag
from cachedemb.modules.factory import register_dynamic
from cachedemb.optim import SparseOptimizer

ON_FULL = ("evict_lfu", "evict_lru", "reject")
UNADMITTED = ("zero", "shared")

def initial_rows(seed: int, ids: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n, dim] N(0, 1) rows (nn.EmbeddingBag's init) as a pure function of (seed, id): a splitmix64 stream
    keyed by the id, pairs of 53-bit uniforms through Box-Muller, computed in float64 on the host.

    The same values, bit for bit, as `cachedemb.dynamic.naive.initial_rows_reference` (the formulation written
    out op by op); this one works in place on two [n, 2P] buffers, which halves its time on admission-heavy
    steps (tests/test_dynamic.py compares the two)."""
    ids = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
    n, pairs = ids.numel(), (dim + 1) // 2
    seed_key = mix64(torch.tensor([_i64(seed)], dtype=torch.int64) + _GOLDEN)
    key = mix64(ids + seed_key)  # [n]
    counter = torch.arange(1, 2 * pairs + 1, dtype=torch.int64) * _GOLDEN  # [2P]
    bits = torch.add(key[:, None], counter[None, :])  # [n, 2P]
    _mix64_(bits, torch.empty_like(bits))
    bits.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)  # the top 53 bits (a logical shift)
    unit = bits.to(torch.float64).mul_(2.0 ** -53).view(n, pairs, 2)  # [n, P, 2] in [0, 1)
    radius = torch.rsub(unit[:, :, 0], 1.0).log_().mul_(-2.0).sqrt_()  # u1 = 1 - unit in (0, 1]
    angle = unit[:, :, 1].mul(2.0 * math.pi)
    z = torch.empty(n, pairs, 2, dtype=torch.float64)
    torch.mul(radius, torch.cos(angle), out=z[:, :, 0])
    torch.mul(radius, angle.sin_(), out=z[:, :, 1])
    return z.view(n, 2 * pairs)[:, :dim].to(dtype)


def _mix64_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """mix64 of x in place (`scratch`: a buffer of x's shape and dtype)."""
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=scratch).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(scratch)
        if mult is not None:
            x.mul_(mult)
    return x


def _unique_sorted(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.unique(ids, sorted=True, return_inverse=True, return_counts=True) of a 1-D int64 CPU tensor, through
    numpy's argsort (faster on the host; the three results are fully determined, so they are the same)."""
    a = ids.numpy()
    n = a.size
    if n == 0:
        return ids.clone(), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    perm = np.argsort(a)
    ordered = a[perm]
    first = np.empty(n, dtype=bool)  # first of its run of equal ids
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    inverse = np.empty(n, dtype=np.int64)
    inverse[perm] = np.cumsum(first) - 1
    counts = np.diff(starts, append=n)
    return torch.from_numpy(ordered[starts]), torch.from_numpy(inverse), torch.from_numpy(counts.astype(np.int64))


@dataclass(frozen=True)
class DynamicIds:
    """Raw int64 ids with a row per admitted id (see the module docstring).

    capacity: rows of the host slab (ids with a row at once). min_count: training occurrences (lookups) an id
    needs before it gets a row; until then it reads the unadmitted row. ttl_steps: ids unseen for this many
    training steps are evicted, swept every ttl_steps steps (or on `evict_stale()`). on_full: when admissions
    find no free row, "evict_lfu" evicts the rows least by (count, last seen, id), "evict_lru" by
    (last seen, count, id), "reject" admits none (rows of the current batch are never victims). unadmitted:
    "zero" (a zero row) or "shared" (one trainable row shared by every unadmitted id). seed: of the initial rows.
    """

    capacity: int
    min_count: int = 1
    ttl_steps: int | None = None
    on_full: str = "evict_lfu"
    unadmitted: str = "zero"
    seed: int = 0

    def __post_init__(self):
        for name in ("capacity", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicIds.{name} must be a positive int, got {value!r}")
        ttl = self.ttl_steps
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"DynamicIds.ttl_steps must be None or a positive int, got {ttl!r}")
        if self.on_full not in ON_FULL:
            raise ValueError(f"DynamicIds.on_full must be one of {ON_FULL}, got {self.on_full!r}")
        if self.unadmitted not in UNADMITTED:
            raise ValueError(f"DynamicIds.unadmitted must be one of {UNADMITTED}, got {self.unadmitted!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"DynamicIds.seed must be an int, got {self.seed!r}")


_STAT_NAMES = ("ids_seen", "admitted", "rejected", "evicted", "expired", "unadmitted_lookups")


@register_dynamic  # CachedEmbeddingBag(None, dim, ..., dynamic=...) builds this class
class DynamicEmbeddingBag(nn.Module):
    """nn.EmbeddingBag over raw int64 ids: an exact host index (id -> slab row) in front of a
    CachedEmbeddingBag over a slab of `dynamic.capacity` rows. Built by
    `CachedEmbeddingBag(None, dim, ..., dynamic=DynamicIds(...))` or directly.

    Training forwards (module.training and grad enabled) count ids, admit, evict; eval forwards only read.
    `padding_idx` is a raw id (every int64 is a valid id). Unknown or not yet admitted ids read the unadmitted
    row (zero, or one shared trainable row), counted in `dynamic_stats()`.

    Example::

        >>> emb = DynamicEmbeddingBag(None, 4, mode="sum", dynamic=DynamicIds(capacity=1000),
        ...                           optimizer=cachedemb.optim.SGD(lr=0.1))
        >>> out = emb(torch.tensor([2**40, -7, 2**40]), torch.tensor([0, 2]))   # 2 bags, 2 new ids admitted
    """

    # prefetch_targets(batch) takes the batch's input by position (modules/batch_input.py): cachedemb.prefetch
    # refuses a default extraction shared by several such modules.
    reads_batch_by_position = True

    def __init__(self, num_embeddings: None, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None, *, dynamic: DynamicIds,
                 optimizer: SparseOptimizer | None = None, cache_ratio: float = 0.01, cache_rows: int | None = None,
                 in_flight_rows: int | None = None, **cache_kwargs):
        super().__init__()
        if num_embeddings is not None:
            raise ValueError(f"with dynamic=DynamicIds(...) the id space is all of int64: pass num_embeddings=None "
                             f"(rows are bounded by DynamicIds.capacity), got {num_embeddings!r}")
        if not isinstance(dynamic, DynamicIds):
            raise TypeError(f"dynamic must be a cachedemb.DynamicIds, got {type(dynamic).__name__}")
        if _weight is not None:
            raise ValueError("_weight cannot be given with dynamic ids: rows are created per id on admission")
        if optimizer is None:
            # A torch optimizer keeps its state per slab row, and a row is reused by other ids after an eviction:
            # the state would leak from one id to the next. Fused optimizers keep per-row state that admission
            # resets. A trained table is served without an optimizer by export_keyed().
            raise ValueError("dynamic ids need a fused sparse optimizer (optimizer=cachedemb.optim.SGD / Adagrad / "
                             "RowWiseAdagrad / Adam(...)), got optimizer=None: a torch optimizer's per-row state "
                             "would follow slab rows reused by other ids. For inference, train (or load a "
                             "state_dict) with a fused optimizer and serve module.export_keyed()")
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
                                        or not -2 ** 63 <= padding_idx < 2 ** 63):
            raise ValueError(f"padding_idx must be an int64 raw id or None, got {padding_idx!r}")
        self.config = dynamic
        self.embedding_dim, self.mode = int(embedding_dim), mode
        self.padding_idx = padding_idx
        self.optimizer = optimizer
        cap = dynamic.capacity
        if in_flight_rows is None:
            in_flight_rows = cap // 8 + 8
        if isinstance(in_flight_rows, bool) or not isinstance(in_flight_rows, int) or in_flight_rows < 0:
            raise ValueError(f"in_flight_rows must be an int >= 0 (spare slab rows for evicted rows that batches "
                             f"read ahead by prefetch still use), got {in_flight_rows!r}")
        slab = cap + in_flight_rows
        self.unadmitted_row = slab
        self.pad_row = slab + 1 if padding_idx is not None else None
        num_rows = slab + 1 + (padding_idx is not None)
        dtype = dtype or torch.get_default_dtype()
        host = torch.zeros(num_rows, self.embedding_dim, dtype=dtype)
        inner = CachedEmbeddingBag(num_rows, self.embedding_dim, max_norm, norm_type, scale_grad_by_freq, mode,
                                   sparse, host, include_last_offset, self.pad_row, device, dtype,
                                   _freeze=optimizer is None, optimizer=optimizer,
                                   cache_ratio=cache_ratio, cache_rows=cache_rows, **cache_kwargs)
        object.__setattr__(self, "inner", inner)  # not a child: state_dict is keyed by raw id (below)
        inner.cache.window_misses_mean_other_ids = False  # rows are remapped (admission, eviction) for its own reasons
        self.index = IdIndex(size=4 * cap)
        self.row_ids = torch.zeros(slab, dtype=torch.int64)  # raw id of each slab row (any int64: no sentinel)
        self.row_slot = torch.full((slab,), -1, dtype=torch.int64)  # its index slot; -1: no admitted id
        self.row_step = torch.zeros(slab, dtype=torch.int64)  # the last training step whose batch reads the row
        self.row_used = torch.zeros(slab, dtype=torch.bool)  # handed out before (its cache copy may exist)
        self._row_slot_version = self.index.version
        self.free_rows = torch.arange(slab - 1, -1, -1, dtype=torch.int64)  # a stack: the top is free_rows[n-1]
        self.n_free = slab
        self.admitted = 0  # ids with a row (<= capacity)
        self.held_rows = torch.zeros(0, dtype=torch.int64)  # evicted rows a batch in flight still reads
        self.held_until = torch.zeros(0, dtype=torch.int64)  # ... the step of the last such batch
        self.done_below = 0  # training batches of steps < done_below have run forward and backward
        self.ahead: deque = deque()  # batches remapped (rows) or queued (None) by prefetch_targets, in order
        self.step = 0
        self.stats = dict.fromkeys(_STAT_NAMES, 0)
        self._state_init = {name: init for name, (_, init) in
                            (optimizer.state_layout(self.embedding_dim) if optimizer else {}).items()}
        self._reset_unadmitted = True

    # ----------------------------------------------------------------- host slab rows
    @property
    def cache(self) -> EmbeddingCache:
        return self.inner.cache

    def _write_rows(self, rows: torch.Tensor, values: torch.Tensor, maybe_cached: torch.Tensor | None = None) -> None:
        """Host rows get `values` and the optimizer's initial state; resident cache copies are overwritten
        (only rows in `maybe_cached`, when given: a row never handed out was never looked up, so never cached)."""
        cache = self.cache
        cache.settle()  # a window's rows still being moved may include these host rows
        cache.host_weight[rows] = values.to(cache.dtype)
        for name, state in cache.host_states.items():
            state[rows] = self._state_init[name]
        cache.host_freq[rows] = 0
        cache.reread_rows(rows if maybe_cached is None else rows[maybe_cached])

    def _zero_unadmitted(self) -> None:
        """With unadmitted="zero": rewrite the unadmitted row to zero if a training forward read it since (its
        backward may have updated it). Not every step: the rewrite re-reads the row into the cache."""
        if self.config.unadmitted == "zero" and self._reset_unadmitted:
            row = torch.tensor([self.unadmitted_row])
            self._write_rows(row, torch.zeros(1, self.embedding_dim))
            self._reset_unadmitted = False

    def _sync_row_slot(self) -> None:
        if self._row_slot_version != self.index.version:
            live = self.index.live_slots()
            rows = self.index.row[live]
            admitted = rows >= 0
            self.row_slot[rows[admitted]] = live[admitted]
            self._row_slot_version = self.index.version

    # ----------------------------------------------------------------- remap
    def _remap(self, input: torch.Tensor, train: bool) -> torch.Tensor:
        if not torch.is_tensor(input) or input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must be an int64 (or int32) tensor of raw ids, got "
                            f"{input.dtype if torch.is_tensor(input) else type(input).__name__}")
        flat = input.reshape(-1).to(device="cpu", dtype=torch.int64)
        rows = self._train_rows(flat) if train else self._rows(flat, train=False)
        if train and not self._reset_unadmitted:
            # This forward's backward updates the unadmitted row only if a lookup reads it (host rows: no sync).
            self._reset_unadmitted = bool((rows == self.unadmitted_row).any())
        return rows.reshape(input.shape).to(input.device)

    def _train_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """A training forward's rows: the queued ones when prefetch remapped this batch ahead, else remapped now."""
        if self.ahead:
            ids, rows, step = self.ahead[0]
            if ids.shape == flat.shape and torch.equal(ids, flat):
                self.ahead.popleft()
                if rows is None:  # read-ahead remapping had paused here: remap now
                    self._done_below(self.step + 1)
                    rows = self._rows(flat, train=True)
                else:
                    self._done_below(step)
                self._catch_up()
                return rows
            # Not the batch read ahead: the read-ahead batches were abandoned (their ids stay counted).
            self.ahead.clear()
            self.inner.cache.unread_ahead += 1  # cachedemb.prefetch warns: other ids than the ones read ahead
        self._done_below(self.step + 1)
        return self._rows(flat, train=True)

    def _catch_up(self) -> None:
        """Remap queued batches ahead, in order, as far as spare rows allow."""
        for i, (ids, rows, _) in enumerate(self.ahead):
            if rows is None:
                rows = self._rows(ids, train=True, ahead=True)
                if rows is None:
                    return
                self.ahead[i] = (ids, rows, self.step)

    def _done_below(self, step: int) -> None:
        """Batches of steps < `step` are done: rows held for them go back on the free list."""
        self.done_below = step
        if self.held_rows.numel():
            done = self.held_until < step
            self._free(self.held_rows[done])
            self.held_rows, self.held_until = self.held_rows[~done], self.held_until[~done]

    def _rows(self, flat: torch.Tensor, train: bool, ahead: bool = False, peek: bool = False) -> torch.Tensor | None:
        """Slab row of each lookup (train: one training step of counting, admission and eviction). `ahead`:
        None, with nothing changed, when the free rows might not cover this batch's admissions. `peek`: not a
        lookup (counts no stats)."""
        keep = None
        ids = flat
        if self.padding_idx is not None:
            keep = flat != self.padding_idx
            ids = flat[keep]
        uniq, inverse, counts = _unique_sorted(ids)
        if ahead:
            ttl = self.config.ttl_steps
            sweep = ttl is not None and self.step > 0 and self.step % ttl == 0
            need = uniq.numel() if sweep else int((self._find(uniq) < 0).sum())
            if need > self.n_free:
                return None
        rows_u = self._admit(uniq, counts) if train else self._find(uniq)
        unadmitted = rows_u < 0
        if not peek:
            self.stats["unadmitted_lookups"] += int(torch.where(unadmitted, counts, 0).sum())
        rows_u = torch.where(unadmitted, self.unadmitted_row, rows_u)
        rows = rows_u.index_select(0, inverse)
        if keep is not None:
            rows = torch.full_like(flat, self.pad_row).masked_scatter_(keep, rows)
        return rows

    def _find(self, uniq: torch.Tensor) -> torch.Tensor:
        """Row of each id, -1 when it has none (read-only)."""
        slots = self.index.lookup(uniq)
        return torch.where(slots >= 0, self.index.row.index_select(0, slots.clamp(min=0)), -1)

    def _admit(self, uniq: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """A training forward's bookkeeping: sweep (every ttl_steps steps), count, admit, evict if full."""
        cfg, index = self.config, self.index
        if cfg.ttl_steps is not None and self.step > 0 and self.step % cfg.ttl_steps == 0:
            self.evict_stale()
        self.step += 1
        index.reserve(uniq.numel())
        slots = index.lookup(uniq)
        new = (slots < 0).nonzero().squeeze(1)
        if new.numel():
            version = index.version
            slots.index_copy_(0, new, index.insert(uniq.index_select(0, new)))
            if index.version != version:
                slots = index.lookup(uniq)
            self.stats["ids_seen"] += new.numel()
        index.count.index_add_(0, slots, counts)  # slots are distinct (distinct ids)
        index.last.index_fill_(0, slots, self.step)
        rows_u = index.row.index_select(0, slots)
        want = (rows_u < 0).logical_and_(index.count.index_select(0, slots) >= cfg.min_count).nonzero().squeeze(1)
        if want.numel():
            short = want.numel() - (cfg.capacity - self.admitted)
            if short > 0 and cfg.on_full != "reject":
                self._evict_for(short, in_batch=rows_u[rows_u >= 0])
            k = min(want.numel(), cfg.capacity - self.admitted)
            assert k <= self.n_free, "spare rows exhausted: the ahead check must have paused"
            self.admitted += k
            self.stats["rejected"] += want.numel() - k
            take = want[:k]  # ascending ids
            rows = self.free_rows[self.n_free - k: self.n_free].flip(0)
            self.n_free -= k
            self._sync_row_slot()
            take_ids, take_slots = uniq.index_select(0, take), slots.index_select(0, take)
            index.row.index_copy_(0, take_slots, rows)
            self.row_ids.index_copy_(0, rows, take_ids)
            self.row_slot.index_copy_(0, rows, take_slots)
            used = self.row_used.index_select(0, rows)
            self.row_used.index_fill_(0, rows, True)
            self._write_rows(rows, initial_rows(cfg.seed, take_ids, self.embedding_dim), maybe_cached=used)
            self.stats["admitted"] += k
            rows_u.index_copy_(0, take, rows)
        admitted = rows_u >= 0
        self.row_step.index_fill_(0, rows_u if bool(admitted.all()) else rows_u[admitted], self.step)
        return rows_u

    def _evict_for(self, need: int, in_batch: torch.Tensor) -> None:
        """Evict up to `need` rows not used by this batch, least by (count, last seen, id) for evict_lfu,
        (last seen, count, id) for evict_lru. O(capacity) on the host, only when the slab is full."""
        self._sync_row_slot()
        used = self.row_slot >= 0
        used[in_batch] = False
        cand = torch.nonzero(used).reshape(-1)
        if cand.numel() == 0:
            return
        need = min(need, cand.numel())
        slots = self.row_slot[cand]
        count, last, ids = self.index.count[slots], self.index.last[slots], self.row_ids[cand]
        keys = (count, last) if self.config.on_full == "evict_lfu" else (last, count)
        if need < cand.numel():  # keep rows whose primary key is at most the need-th smallest
            bound = torch.kthvalue(keys[0], need).values
            sub = keys[0] <= bound
            cand, ids, keys = cand[sub], ids[sub], (keys[0][sub], keys[1][sub])
        order = torch.argsort(ids, stable=True)
        order = order[torch.argsort(keys[1][order], stable=True)]
        order = order[torch.argsort(keys[0][order], stable=True)]
        self._evict_rows(cand[order[:need]])

    def _evict_rows(self, rows: torch.Tensor) -> None:
        """Drop the ids of these rows entirely (index entry, count); the rows go back on the free list, or are
        held while a batch in flight reads them. Their contents are rewritten when a row is given out again."""
        if rows.numel() == 0:
            return
        self._sync_row_slot()
        self.index.remove(self.row_slot[rows])
        self.row_slot[rows] = -1
        self.admitted -= rows.numel()
        self.stats["evicted"] += rows.numel()
        until = self.row_step[rows]
        in_flight = until >= self.done_below
        self.held_rows = torch.cat([self.held_rows, rows[in_flight]])
        self.held_until = torch.cat([self.held_until, until[in_flight]])
        self._free(rows[~in_flight])

    def _free(self, rows: torch.Tensor) -> None:
        self.free_rows[self.n_free: self.n_free + rows.numel()] = rows.sort(descending=True).values
        self.n_free += rows.numel()

    def evict_stale(self, ttl_steps: int | None = None) -> int:
        """Evict every id (admitted or still counting) unseen in the last `ttl_steps` training steps (default:
        the configured ttl_steps). O(tracked ids). Returns the number of admitted ids evicted."""
        ttl = ttl_steps if ttl_steps is not None else self.config.ttl_steps
        if ttl is None:
            raise ValueError("evict_stale() needs ttl_steps: configure DynamicIds(ttl_steps=N) or pass it")
        index = self.index
        live = index.live_slots()
        stale = live[self.step - index.last[live] >= ttl]
        rows = index.row[stale]
        admitted = rows >= 0
        before = self.stats["evicted"]
        self._evict_rows(rows[admitted])
        pending = stale[~admitted]
        index.remove(pending)
        self.stats["expired"] += pending.numel()
        return self.stats["evicted"] - before

    # ----------------------------------------------------------------- nn.Module
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        train = self.training and torch.is_grad_enabled()
        self._zero_unadmitted()
        rows = self._remap(input, train)
        self.inner.training = self.training
        return self.inner(rows, offsets, per_sample_weights)

    def prefetch_targets(self, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
        """The prefetch stage (cachedemb.prefetch reads batches ahead in training order): a training-mode module
        remaps `batch` now and queues its rows for its forward; returns its slab rows for the cache window.
        When spare rows run short (or in eval mode) it returns the rows its ids have now and the forward remaps."""
        flat = batch_input(batch).reshape(-1).to(device="cpu", dtype=torch.int64)
        rows = None
        if self.training and torch.is_grad_enabled():
            if all(queued is not None for _, queued, _ in self.ahead):
                rows = self._rows(flat, train=True, ahead=True)
            self.ahead.append((flat, rows, self.step if rows is not None else -1))
        if rows is None:
            rows = self._rows(flat, train=False, peek=True)
        rows = torch.unique(rows)
        return [(self.cache, rows[rows < self.unadmitted_row].to(self.cache.device))]

    def dynamic_stats(self) -> dict[str, int]:
        """Counters since construction: ids_seen (distinct ids entered into the index), admitted, rejected (ids
        due a row that found none free), evicted (admitted ids dropped: capacity or ttl), expired (counting ids
        dropped by ttl), unadmitted_lookups (lookups served by the unadmitted row); and the current rows_in_use,
        counting_ids (seen, not admitted), held_rows (evicted, read by a batch in flight), slab_rows (rows for
        ids, fixed), index_slots, max_probe (longest displacement in the index)."""
        out = dict(self.stats)
        out["rows_in_use"] = self.admitted
        out["held_rows"] = self.held_rows.numel()
        out["slab_rows"] = self.row_ids.numel()
        out["counting_ids"] = self.index.live - out["rows_in_use"]
        out["index_slots"] = self.index.size
        out["max_probe"] = self.index.max_disp
        return out

    def cache_stats(self) -> dict:
        return self.inner.cache_stats()

    def reset_cache_stats(self) -> None:
        self.inner.reset_cache_stats()

    def flush(self) -> None:
        self.inner.flush()

    def export_keyed(self) -> KeyedEmbeddingBag:
        """A plain keyed lookup (sorted ids + rows, searchsorted, F.embedding_bag) equal to this module's eval
        forward for every id, unknown ids included; traceable by torch.export. Copies the admitted rows."""
        self.inner.flush()
        index, cache = self.index, self.cache
        live = index.live_slots()
        rows = index.row[live]
        admitted = rows >= 0
        ids, order = torch.sort(index.keys[live[admitted]])
        rows = rows[admitted][order]
        self._zero_unadmitted()
        extra = [self.unadmitted_row] + ([self.pad_row] if self.pad_row is not None else [])
        weight = cache.host_weight[torch.cat([rows, torch.tensor(extra)])].clone()
        return KeyedEmbeddingBag(ids, weight, self.mode, self.padding_idx, self.inner.include_last_offset)

    # ----------------------------------------------------------------- checkpoints
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Keyed by raw id, in id order (independent of slab layout): ids, weight, optimizer.<state>, counts,
        last_seen; the ids still counting (pending_*); step, optimizer.step; the unadmitted row when it is
        trained (shared). Plain tensors: loadable with torch.load(weights_only=True)."""
        self.inner.flush()
        cache, index = self.cache, self.index
        live = index.live_slots()
        rows = index.row[live]
        admitted = rows >= 0
        ids, order = torch.sort(index.keys[live[admitted]])
        slots, rows = live[admitted][order], rows[admitted][order]
        destination[prefix + "ids"] = ids
        destination[prefix + "weight"] = cache.host_weight[rows].clone()
        for name, state in cache.host_states.items():
            destination[prefix + f"optimizer.{name}"] = state[rows].clone()
        destination[prefix + "counts"] = index.count[slots].clone()
        destination[prefix + "last_seen"] = index.last[slots].clone()
        pending_ids, order = torch.sort(index.keys[live[~admitted]])
        pending = live[~admitted][order]
        destination[prefix + "pending_ids"] = pending_ids
        destination[prefix + "pending_counts"] = index.count[pending].clone()
        destination[prefix + "pending_last_seen"] = index.last[pending].clone()
        destination[prefix + "step"] = torch.tensor(self.step, dtype=torch.int64)
        destination[prefix + "optimizer.step"] = torch.tensor(self.inner.optimizer_step, dtype=torch.int64)
        if self.config.unadmitted == "shared":
            row = self.unadmitted_row
            destination[prefix + "unadmitted.weight"] = cache.host_weight[row].clone()
            for name, state in cache.host_states.items():
                destination[prefix + f"unadmitted.optimizer.{name}"] = state[row].clone()

    def _state_keys(self, prefix) -> list[str]:
        names = list(self.cache.host_states)
        keys = ["ids", "weight", "counts", "last_seen", "pending_ids", "pending_counts", "pending_last_seen",
                "step", "optimizer.step"] + [f"optimizer.{n}" for n in names]
        if self.config.unadmitted == "shared":
            keys += ["unadmitted.weight"] + [f"unadmitted.optimizer.{n}" for n in names]
        return [prefix + k for k in keys]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        keys = self._state_keys(prefix)
        missing = [k for k in keys if k not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in keys)
        get = lambda name: state_dict[prefix + name]  # noqa: E731
        ids, weight = get("ids").to(torch.int64), get("weight")
        n, cap = ids.numel(), self.config.capacity
        if n > cap or tuple(weight.shape) != (n, self.embedding_dim):
            error_msgs.append(f"{prefix}weight: expected at most {cap} rows of {self.embedding_dim} "
                              f"(DynamicIds.capacity, embedding_dim) matching {prefix}ids, got {tuple(weight.shape)} "
                              f"for {n} ids")
            return
        cache = self.cache
        cache.flush()
        index = IdIndex(size=4 * cap)
        rows = torch.arange(n, dtype=torch.int64)
        slots = index.insert(ids)
        index.row[slots], index.count[slots], index.last[slots] = rows, get("counts"), get("last_seen")
        pending = index.insert(get("pending_ids").to(torch.int64))
        index.count[pending], index.last[pending] = get("pending_counts"), get("pending_last_seen")
        self.index, self._row_slot_version = index, index.version
        self.row_ids.zero_()
        self.row_ids[:n] = ids
        self.row_slot.fill_(-1)
        self.row_slot[:n] = slots
        slab = self.row_ids.numel()
        self.free_rows = torch.arange(slab - 1, n - 1, -1, dtype=torch.int64)
        self.free_rows = torch.cat([self.free_rows, torch.zeros(n, dtype=torch.int64)])
        self.n_free, self.admitted = slab - n, n
        self.row_step.zero_()
        self.row_used.fill_(True)  # rows of the module before the load may still be cached
        self.held_rows, self.held_until = self.held_rows[:0], self.held_until[:0]
        self.ahead.clear()
        cache.host_weight[:n] = weight
        for name, state in cache.host_states.items():
            state[:n] = get(f"optimizer.{name}")
        cache.host_freq.zero_()
        if self.config.unadmitted == "shared":
            cache.host_weight[self.unadmitted_row] = get("unadmitted.weight")
            for name, state in cache.host_states.items():
                state[self.unadmitted_row] = get(f"unadmitted.optimizer.{name}")
        self.step = int(get("step"))
        self.done_below = self.step + 1
        self.inner.optimizer_step = int(get("optimizer.step"))
        self._reset_unadmitted = True
        cache.reload()

    def train(self, mode: bool = True):
        super().train(mode)
        self.inner.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        self.inner._apply(fn)
        return self

    def extra_repr(self) -> str:
        return f"None, {self.embedding_dim}, mode={self.mode!r}, dynamic={self.config}, cache={self.inner.cache.capacity}"
