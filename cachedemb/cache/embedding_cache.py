"""The software cache: a host table behind a device cache of a fixed number of rows.

Host side (pinned when CUDA exists): the full table, the optimizer state of every row, and every id's access
count. Device side, all O(cache rows): the cached rows and their optimizer state, slot -> id, per-slot count,
last use and dirty bit, and an id -> slot hash index (`kernels.id_index`): a batch looks up its distinct ids and
inserts / deletes only its misses and their victims' ids. Its tombstones are cleared by a rebuild (O(cache))
that runs only once enough inserts could have filled the table (`seconds["index_rebuild"]`).

When a batch's unique ids cannot all be resident at once (more misses than free slots, e.g. while a prefetch
window protects most slots), the rest are served straight from the host table through pinned memory: the
forward reads those rows there and the fused optimizer updates them (and their state) there, in place, so a
batch of any size gives the exact result and device memory never grows with the batch (FBGEMM serves its cache
misses from UVM the same way).

Every per-batch step works on fixed-capacity buffers with device-side counts, so on CUDA no step needs a host
sync. On CPU the counts are read on the host (free there) to skip work, except in the sync-free mode
(`CACHEDEMB_SYNC_FREE=1`), where CPU tensors follow the CUDA rules exactly.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cachedemb import kernels
from cachedemb.cache.ahead import AheadBatch, take_ahead
from cachedemb.cache.exact_device import exact_device
from cachedemb.cache.host_memory import host_empty, pinned_copy
from cachedemb.kernels import PROTECTED, id_index
from cachedemb.kernels.gather import take
from cachedemb.cache.policy import Policy, SlotView, resolve, score_kernel
from cachedemb.cache import device_place, place_native, pool_native, staging
from cachedemb.cache.sync_mode import counts_on_host
from cachedemb.cache.victim_pool import VictimPool
from cachedemb.cache.counters import SECONDS, hit_rate, named_seconds, window_rows_as_misses
from cachedemb.cache.window_misses import WindowMisses

PREFETCH_STAGES = ("prefetch_read", "prefetch_wait", "prefetch_unique", "prefetch_next_use", "prefetch_window_plan",
                   "prefetch_forward_unique", "prefetch_next_use_query")
STAT_NAMES = ("lookups", "unique", "hits", "misses", "evictions", "rows_in", "rows_out", "windows",
              "window_rows_in", "host_rows", "invalid_ids", "invalid_offsets", "window_misses")
_STAT = {name: i for i, name in enumerate(STAT_NAMES)}


@dataclass
class BatchPlan:
    """Where one batch's rows sit for its forward and backward."""

    # Per-unique tensors have a capacity U >= n_uniq: B on CUDA (no sync), exactly n_uniq on CPU.
    uniq: torch.Tensor  # [U] unique ids ascending, then -1
    inverse: torch.Tensor  # [B] unique position of each lookup, -1 for padding
    counts: torch.Tensor  # [U] occurrences of each unique id
    n_uniq: torch.Tensor  # [1]
    loc_u: torch.Tensor  # [U] cache slot of each unique id; <= -2: its host row (HOST_LOC); -1 past n_uniq
    generation: int  # the cache generation the locations belong to
    # (perm [B], ptr [B + 1]): the lookups grouped by unique position, from unique_ids' sort; the backward
    # reduces each id's lookups in this order instead of sorting the inverse again (lookup_groups)
    groups: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B] int64 for the forward to record each lookup's bag in, for the backward (under the CUDA rules)
    bag: torch.Tensor | None = None


@dataclass
class RowMove:
    """The row copies of one admission, captured before the slot metadata changed, so they can run later (on a
    side stream) without reading metadata: dirty victims out, missing rows in."""

    victims: torch.Tensor  # [k] slots
    n_admit: torch.Tensor  # [1] victims actually used
    old_ids: torch.Tensor  # [k] id each victim held (-1 empty): its count goes back to the host
    dirty_ids: torch.Tensor  # [k] id to write back, -1 for a clean victim
    miss_ids: torch.Tensor  # [U + 1] missing ids in rank order
    miss_dest: torch.Tensor  # [U + 1] their slots
    n_miss: torch.Tensor  # [1]

    def tensors(self):
        return (self.victims, self.n_admit, self.old_ids, self.dirty_ids, self.miss_ids, self.miss_dest, self.n_miss)


@dataclass
class SlotNextUse:
    """Batches from `now` to the next known use (-1 for none) of the id each of the C slots held when `ids` was
    taken: the look-ahead policy's input, computed off the training thread from a snapshot. A slot whose id
    changed since counts as having no known use. `epoch`: the cache's `slot_epoch` at the snapshot; where no
    slot can have changed since (counts on the host), the uses are taken as they are, with no O(cache) pass on
    the training thread (the owner hands over a tensor it no longer writes)."""

    ids: torch.Tensor  # [C] slot ids at the snapshot
    uses: torch.Tensor  # [C] batches from `now`
    now: int
    epoch: int | None = None


@dataclass
class WindowPlan:
    """A look-ahead window whose slots are decided (metadata and index already updated) and whose rows are
    moved by `EmbeddingCache.transfer_window`; `done` is what to wait for until they are in place: the CUDA event
    recorded after a side stream's copies, or the future of a host thread's copies (CPU)."""

    loc_u: torch.Tensor
    move: RowMove | None
    done: object = None


@dataclass
class BackgroundPlan:
    """A window planned and moved on a host thread while the window before it is in use (CPU, counts on the host:
    `EmbeddingCache.plan_in_background`). `run` plans and moves it and sets `plan` (None: nothing was planned);
    the bumps of the cache's counters it made wait in `stats` until the training thread takes the plan."""

    run: object  # callable(), run once: on the host thread, or on the training thread if nothing started it
    plan: WindowPlan | None = None
    stats: list = field(default_factory=list)
    done: object = None  # the host thread's future, once started


# The cache a background window plan is being made for on this thread, and where its counter bumps wait.
_PLANNING = threading.local()


def state_dtype(table_dtype: torch.dtype) -> torch.dtype:
    """Optimizer state is kept in the accumulation dtype: float64 for a float64 table, else float32."""
    return torch.float64 if table_dtype == torch.float64 else torch.float32


def pinned_empty(shape, dtype) -> torch.Tensor:
    """Host memory of exactly this size, registered with CUDA (DMA and zero-copy access) when CUDA exists."""
    return host_empty(shape, dtype, pinned=torch.cuda.is_available())


class EmbeddingCache:
    """Host table + per-row optimizer state + access counts, behind `capacity` device rows."""

    def __init__(self, host_weight: torch.Tensor, capacity: int, device: torch.device,
                 state_layout: dict[str, tuple[int, float]], policy: str | Policy = "lfu",
                 host_freq: torch.Tensor | None = None, history: int = 0, freq_halflife: int | None = None):
        num_rows, dim = host_weight.shape
        if not 1 <= capacity <= max(num_rows, 1):
            raise ValueError(f"cache capacity must be in [1, {num_rows}] rows, got {capacity}")
        if num_rows > id_index.MAX_ID or capacity > id_index.SLOT_MASK:
            raise ValueError(f"the id index packs ids < 2^33 and slots < 2^30, got a table of {num_rows} rows and "
                             f"a cache of {capacity}: shard the table")
        self.num_rows, self.dim, self.capacity = num_rows, dim, int(capacity)
        self.device = exact_device(device)
        self.dtype = host_weight.dtype
        self.policy: Policy = resolve(policy)
        self.host_weight = self._readable(host_weight)
        self.host_states: dict[str, torch.Tensor] = {}
        for name, (cols, init) in state_layout.items():
            state = pinned_empty((num_rows, cols), state_dtype(self.dtype))
            state.fill_(init)
            self.host_states[name] = state
        self.host_freq = pinned_empty((num_rows,), torch.int64)
        if host_freq is None:
            self.host_freq.zero_()
        else:
            self.host_freq.copy_(host_freq)
        self.rows = torch.empty(0, dim, dtype=self.dtype, device=self.device)
        self.rows_spare = None
        self.maybe_dirty = False  # host-side: set when rows are marked dirty, cleared by flush / reload
        self.generation = 0
        self.batch_counter = 0
        self.slot_epoch = 0  # moves on wherever slot ids may change (a snapshot's next uses stay valid while equal)
        self._allocate(self.capacity)
        self.stats = torch.zeros(len(STAT_NAMES), dtype=torch.int64, device=self.device)
        self.stat_index = _STAT  # name -> position in `stats`, for kernels that add to them
        # Optional bounded per-batch history: a ring of cumulative counters, written on the device (no sync).
        if history < 0:
            raise ValueError(f"history must be >= 0 batches, got {history}")
        self.history = torch.zeros(history, len(STAT_NAMES), dtype=torch.int64, device=self.device)
        self.history_batches = 0
        # Host seconds per phase; the O(cache) passes each have their own entry and run at most once per window
        # (victim_rank: only when the victim pool runs dry, under the CUDA rules the gated launch of every batch;
        # next_use_refresh; window_protect), per index fill (index_rebuild) or per `freq_halflife` batches
        # (halve_counts). The prefetch pipeline's stages (cachedemb/prefetch) add theirs: prefetch_read (the
        # training thread reading and extracting batches), prefetch_wait (it waiting for the read-ahead thread),
        # and on the read-ahead thread prefetch_unique, prefetch_next_use, prefetch_window_plan,
        # prefetch_forward_unique and prefetch_next_use_query.
        self.seconds = {"prepare": 0.0, "admit_window": 0.0, "flush": 0.0, "index_rebuild": 0.0,
                        "victim_rank": 0.0, "next_use_refresh": 0.0, "halve_counts": 0.0, "window_protect": 0.0,
                        "transfer_wait": 0.0,
                        **dict.fromkeys(PREFETCH_STAGES, 0.0)}
        if freq_halflife is not None and (not isinstance(freq_halflife, int) or freq_halflife < 1):
            raise ValueError(f"freq_halflife must be None or a positive number of batches, got {freq_halflife!r}")
        self.freq_halflife = freq_halflife
        self.train_batches = 0
        self._pending = None  # a window transfer still running (CUDA event of a side stream, or a CPU future)
        self._deferred = None  # (plan, host thread) of a CPU window transfer not started yet (see transfer_window)
        self._background: BackgroundPlan | None = None  # the last window planned on a host thread, not yet taken
        # Forwards the prefetch pipeline announced as its window's (all hits); any other forward while a window
        # transfer is in flight waits for it, since the rows it serves from the host may be in transit.
        self.window_forwards_left = 0
        self.ahead: AheadBatch | None = None  # the pipeline's hand-off for the next forward (cache/ahead.py)
        # Lookups of announced forwards that the pipeline had not read ahead (misses inside an admitted window, a
        # hand-off whose ids differed): nonzero means a forward's ids are not those prefetched for it. Summed on
        # the device; the pipeline reads it without a sync and warns.
        self.unread_ahead = torch.zeros(1, dtype=torch.int64, device=self.device)
        # False behind a layer that maps ids to this cache's rows (raw ids, a host tier): its forwards may miss
        # inside a window for reasons of its own, and the layer compares the ids itself.
        self.window_misses_mean_other_ids = True
        # Under the CUDA rules, the [1] miss count of the last announced forward inside a window (a view of that
        # batch's buffers), for the pipeline to copy without blocking at the next window start.
        self.window_forward_misses: torch.Tensor | None = None
        self._windows: list[torch.Tensor] = []  # slots (loc_u) of the prefetch windows protected now
        # Slots beyond `cache_rows` where a prefetch loop stages the next window's rows while the current one
        # computes (`reserve_staging`, docs/prefetch.md); `capacity` counts them, `cache_rows` does not.
        self.staging_rows = 0
        self._window_active = False  # an admitted window is protected (activate_window .. the next drop)
        self.table_starts = self.table_ranks = None  # set_tables(): per-table ranks for the policies
        # A host tier in front of this cache (cachedemb.storage) that fills host rows asynchronously: called
        # with a window's ids before its admission reads their host rows, so rows still being read land first.
        self.host_fence = None

    # ----------------------------------------------------------------- device buffers
    def _allocate(self, slots: int) -> None:
        dev = self.device
        self._set_rows(torch.zeros(slots, self.dim, dtype=self.dtype, device=dev))
        self.states = {name: torch.zeros(slots, h.shape[1], dtype=h.dtype, device=dev)
                       for name, h in self.host_states.items()}
        # Per-slot metadata has one trailing "dump" element: masked scatters write there instead of syncing.
        self.slot_ids = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)
        self.slot_freq = torch.zeros(slots + 1, dtype=torch.int64, device=dev)
        self.slot_last_use = torch.zeros(slots + 1, dtype=torch.int64, device=dev)
        self.dirty = torch.zeros(slots + 1, dtype=torch.bool, device=dev)
        self.next_use = torch.full((self.capacity,), -1, dtype=torch.int64, device=dev)
        self.protected = torch.zeros(self.capacity + 1, dtype=torch.bool, device=dev)
        # under the CUDA rules a batch's hits are protected here, apart from the window's `protected`
        self.hit_mark = torch.zeros(self.capacity + 1, dtype=torch.bool, device=dev)
        self._n_protected = torch.zeros(1, dtype=torch.int64, device=dev)  # protected[:C].sum(), per window
        # The id index packs each resident id with its slot in one int64 entry; index_slots stays empty.
        self.index_keys = id_index.new_index(self.capacity, dev)
        self.index_slots = torch.empty(0, dtype=torch.int64, device=dev)
        # Bound on the table positions not EMPTY (resident ids + tombstones): a rebuild clears the tombstones
        # before they pass 5/8 of the table, so probe chains stay short; the count is kept on the device
        # (`index_used`) and the rebuild is gated there (cachedemb/cache/device_place.py).
        self.index_used = torch.zeros(1, dtype=torch.int64, device=dev)
        # The host-count path (CPU) keeps a dense host map instead, `id_slot` [num_rows] int32 (-1: not resident;
        # 4 B per table row in host memory, beside the counts' 8): a lookup is one gather, an admission one
        # scatter, no rebuild. One structure is live at a time; a path finding the other's rebuilds its own from
        # slot_ids (O(cache), at a switch of sizing rules only).
        self.id_slot = None
        self._live_index = "hash"
        self._index_limit = (id_index.index_size(self.capacity) * 5) // 8
        self.victim_pool = VictimPool(self.capacity, dev)
        self.window_misses: WindowMisses | None = None  # while a prefetch loop runs (cache/window_misses.py)
        self._window_admits: list = []  # (window slots, [1] rows it admitted), under the CUDA rules

    def _set_rows(self, data: torch.Tensor, spare: int = 0) -> None:
        """The cache rows; on CPU they are the first C rows of `rows_spare`, a buffer with room for `spare` more:
        the host-served rows of a batch are gathered there for the reference forward (kernels.with_host_rows)."""
        if data.device.type != "cpu":
            self.rows, self.rows_spare = data, None
            return
        # exact-size, huge-page advised memory: a batch's rows sit at random in a cache of tens to hundreds of
        # MB, and with 4 KiB pages most row reads and updates miss the TLB
        buf = host_empty((data.shape[0] + spare, data.shape[1]), data.dtype, pinned=False)
        buf[: data.shape[0]].copy_(data)
        self.rows, self.rows_spare = buf[: data.shape[0]], buf

    def _reserve_spare(self, rows: int) -> None:
        """Room for `rows` host-served rows after the cache rows (CPU), grown by doubling."""
        if self.rows_spare is not None and self.rows_spare.shape[0] - self.rows.shape[0] < rows:
            self._set_rows(self.rows, max(rows, 2 * (self.rows_spare.shape[0] - self.rows.shape[0])))

    @property
    def total_slots(self) -> int:
        return self.capacity

    @property
    def dump(self) -> int:
        return self.total_slots

    def _on_host(self, count: torch.Tensor, upper: int) -> int:
        """A device count as a host int where that costs no sync (CPU, outside the sync-free mode); else its
        static upper bound."""
        if counts_on_host(count.device):
            return int(count)
        return upper

    def _planning_in_background(self) -> bool:
        """Whether this thread is making a background window plan for this cache (`plan_in_background`)."""
        return getattr(_PLANNING, "cache", None) is self

    def bump_stats(self, **values: torch.Tensor) -> None:
        """Add [1] device counts to the counters, on the device (no host copy of an index: that would sync)."""
        if self._planning_in_background():  # a background window plan: added when it is taken
            _PLANNING.stats.append(values)
            return
        for key, value in values.items():
            i = _STAT[key]
            self.stats[i:i + 1].add_(value.reshape(1).to(torch.int64))

    def invalid_counts(self) -> torch.Tensor:
        """The [invalid_ids, invalid_offsets] counters as one [2] view, for input repair on the device to add to."""
        return self.stats[_STAT["invalid_ids"]:_STAT["invalid_ids"] + 2]

    def device_bytes(self) -> int:
        """Bytes this cache holds on its device: rows, optimizer state, slot metadata, index, counters. Per-batch buffers are transient: O(lookups) ids and O(distinct ids) rows.
        The victim pool (at most C int64 slots, from the first full ranking on) is `victim_pool_bytes()`."""
        tensors = [self.rows.data, self.slot_ids, self.slot_freq, self.slot_last_use, self.dirty, self.next_use,
                   self.protected, self.hit_mark, self.index_keys, self.index_slots, self.index_used, self.stats,
                   self.history]
        tensors += list(self.states.values())
        tensors += [self.window_misses.marks] if self.window_misses is not None else []
        tensors += [t for t in (self.table_starts, self.table_ranks) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ----------------------------------------------------------------- row movement
    def _row_tensors(self):
        """(device tensor, host tensor) pairs that move together when a row moves."""
        pairs = [(self.rows.data, self.host_weight)]
        pairs += [(self.states[k], self.host_states[k]) for k in self.host_states]
        return pairs

    def _write_back(self, slots: torch.Tensor, n) -> torch.Tensor:
        """Write the first n `slots` back to the host: rows and state if dirty, counts always.
        Returns the number of dirty rows written ([1] tensor)."""
        ids = take(self.slot_ids, slots)
        dirty = take(self.dirty, slots) & (ids >= 0)
        live = torch.arange(slots.numel(), device=self.device) < n
        self._copy_out(slots, torch.where(dirty, ids, torch.full_like(ids, -1)), ids, n)
        return (dirty & live).sum().reshape(1)

    def _copy_out(self, slots, dirty_ids, ids, n) -> None:
        """Rows and state of the first n `slots` to the host rows `dirty_ids` (-1 skips: clean), counts to `ids`."""
        copies = [kernels.RowCopy(dev_t, slots, host_t, dirty_ids) for dev_t, host_t in self._row_tensors()]
        kernels.row_copy_many(copies + [kernels.RowCopy(self.slot_freq, slots, self.host_freq, ids)], n)

    def _fill(self, ids: torch.Tensor, slots: torch.Tensor, n) -> None:
        """Gather rows, state and counts of the first n `ids` from the host into `slots`."""
        copies = [kernels.RowCopy(host_t, ids, dev_t, slots) for dev_t, host_t in self._row_tensors()]
        kernels.row_copy_many(copies + [kernels.RowCopy(self.host_freq, ids, self.slot_freq, slots)], n)

    def _masked_put(self, target: torch.Tensor, index: torch.Tensor, values, n) -> None:
        """target[index[i]] = values[i] for i < n, without a host sync (the rest go to the dump element)."""
        live = torch.arange(index.numel(), device=index.device) < n
        index = torch.where(live & (index >= 0), index, torch.full_like(index, self.dump))
        target.index_put_((index,), values)

    def _early_exit(self) -> bool:
        return counts_on_host(self.device)

    def _rebuild_index(self) -> None:
        """Lay the index out afresh from slot_ids (O(cache), tombstones cleared; every resident id placed, no
        slot moves)."""
        start = time.perf_counter()
        ids = self.slot_ids[: self.capacity]
        id_index.index_build(self.index_keys, ids, torch.arange(self.capacity, device=self.device))
        self.index_used.copy_((self.index_keys != id_index.EMPTY).sum().reshape(1))
        self.seconds["index_rebuild"] += time.perf_counter() - start

    def _use_map(self) -> torch.Tensor:
        """The dense host map, live (rebuilt from slot_ids when the hash index was)."""
        if self._live_index != "map":
            if self.id_slot is None:
                self.id_slot = torch.full((self.num_rows,), -1, dtype=torch.int32)
            else:
                self.id_slot.fill_(-1)
            ids = self.slot_ids[: self.capacity].cpu()
            live = ids >= 0
            self.id_slot[ids[live]] = torch.arange(self.capacity, dtype=torch.int32)[live]
            self._live_index = "map"
        return self.id_slot

    def _use_hash(self) -> None:
        """The device hash index, live (rebuilt from slot_ids when the map was)."""
        if self._live_index != "hash":
            self._rebuild_index()
            self._live_index = "hash"

    # ----------------------------------------------------------------- per-batch planning
    def prepare(self, ids: torch.Tensor, padding_idx: int | None = None, train: bool = True) -> BatchPlan:
        """Make every id of the batch addressable; returns where each unique id sits.

        Hits stay where they are (protected for this batch); misses take the policy's victims, and those that
        cannot fit are served from the host table in place. Counts and recency are updated only when `train`.
        """
        start = time.perf_counter()
        ids = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        n_lookups = ids.numel()
        in_window = self._wait_for_window_rows()
        self.generation += 1
        self.batch_counter += 1
        ahead, self.ahead = self.ahead, None
        if not self._early_exit():
            if self.device.type != "cuda":
                self.settle()  # a miss served from the host must not race a host thread's write-back
            return self._prepare_device(ids, padding_idx, train, start, admit=not in_window)
        offered = ahead
        ahead = take_ahead(ahead, ids, padding_idx, self.slot_ids)
        if ahead is None and offered is not None and train and offered.ids.shape == ids.shape and \
                padding_idx is None and self.window_misses_mean_other_ids:
            self.unread_ahead += 1  # the same number of lookups as read ahead, other ids (take_ahead compared them)
        uniq, inverse, counts, n_uniq, groups = (ahead[0] if ahead else
                                                 kernels.unique_ids(ids, padding_idx, return_groups=True,
                                                                    id_bound=self.num_rows))
        # Per-unique buffers: exactly n long on CPU (free to know there), the fixed capacity B on CUDA.
        cap = self._on_host(n_uniq, n_lookups)
        uniq, counts = uniq[:cap], counts[:cap]
        if ahead and ahead[1] is not None:  # every id in a window's slots: nothing to place
            loc_u, live = ahead[1], torch.ones(cap, dtype=torch.bool, device=self.device)
            n_hit = (loc_u >= 0).sum().reshape(1)  # (a window that did not fit serves the rest from the host)
            n_miss = n_uniq - n_hit
            self._count_window_misses(loc_u)
        else:
            self.settle()  # misses may read host rows that a window transfer in flight writes back
            loc_u, live, n_hit, n_miss, move = self._place(uniq, n_uniq, self.policy)
            self._count_window_misses(loc_u, move)
            if in_window and train and self.window_misses_mean_other_ids:
                self.unread_ahead += n_miss.reshape(1)
        c = place_native.NATIVE.get()
        lookups = None if c is None else place_native.count_uses(
            c, loc_u, live, counts, inverse, self.dump, self.batch_counter, self.slot_freq, self.slot_last_use,
            self.host_freq, train)
        if lookups is not None:
            self.bump_stats(lookups=lookups, unique=n_uniq, hits=n_hit, misses=n_miss)
            return self._finish_prepare(BatchPlan(uniq, inverse, counts, n_uniq, loc_u, self.generation, groups),
                                        train, start)
        self.bump_stats(lookups=(inverse >= 0).sum(), unique=n_uniq, hits=n_hit, misses=n_miss)
        if train:
            resident = live & (loc_u >= 0)
            dumped = torch.where(resident, loc_u, torch.full_like(loc_u, self.dump))
            self.slot_freq.index_add_(0, dumped, counts)
            self.slot_last_use.index_fill_(0, dumped, self.batch_counter)
            # Rows served from the host count there (distinct ids: a plain add).
            on_host = live & (loc_u <= kernels.HOST_LOC)
            positions = torch.arange(cap, device=self.device)
            kernels.row_copy(counts, torch.where(on_host, positions, -1), self.host_freq,
                             torch.where(on_host, kernels.host_loc(loc_u), -1), cap, accumulate=True)
        return self._finish_prepare(BatchPlan(uniq, inverse, counts, n_uniq, loc_u, self.generation, groups), train,
                                    start)

    def _prepare_device(self, ids: torch.Tensor, padding_idx, train: bool, start: float,
                        admit: bool = True) -> BatchPlan:
        """prepare under the CUDA rules: a fixed sequence of fused launches (cachedemb/cache/device_place.py).
        `admit=False`: the prefetch pipeline's batch inside its admitted window, all hits: lookup and commit only
        (a miss there, should the ids differ from those read ahead, is served from the host: still exact)."""
        self.slot_epoch += 1
        sizes, bufs = device_place.batch(self, self.policy, ids.numel(), with_unique=True, admit=admit)
        uniq, inverse, counts, n_uniq, groups = device_place.unique(self, ids, padding_idx, bufs)
        loc_u, _, n_miss, move = device_place.place_batch(self, uniq, n_uniq, self.policy, bufs, sizes,
                                                          counts=counts, train=train, count_lookups=True, admit=admit)
        if admit:
            move = RowMove(*move)
            self._move_rows(move, add=bufs.add if train else None)
        elif train and self.window_misses_mean_other_ids:  # every id of the window was read ahead: a miss means
            self.window_forward_misses = n_miss                # the forward's ids differ (kept, not added: no launch)
        self._count_window_misses(loc_u, move if admit else None)
        plan = BatchPlan(uniq, inverse, counts, n_uniq, loc_u, self.generation, groups, bufs.bag)
        return self._finish_prepare(plan, train, start)

    def _finish_prepare(self, plan: BatchPlan, train: bool, start: float) -> BatchPlan:
        if train:
            self.train_batches += 1
            if self.freq_halflife and self.train_batches % self.freq_halflife == 0:
                self.halve_counts()
        if self.history.shape[0]:
            self.history[self.history_batches % self.history.shape[0]] = self.stats
        self.history_batches += 1
        self.seconds["prepare"] += time.perf_counter() - start
        return plan

    def _count_window_misses(self, loc_u: torch.Tensor, move: RowMove | None = None) -> None:
        """While a prefetch loop runs: the batch's rows a window admitted, first looked up now, count as its
        misses (`move`: the batch's own admissions, whose slots lose a window's stale mark first)."""
        if self.window_misses is None:
            return
        if move is not None and move.miss_dest is not None:
            self.window_misses.admitted(move.miss_dest, move.n_miss, by_window=False)
        i = _STAT["window_misses"]
        self.window_misses.count(loc_u, self.stats[i:i + 1])

    def _end_windows(self, keep=None) -> None:
        """Under the CUDA rules the rows a window admitted count as misses when it ends (its batches have run):
        one add per window instead of per-slot marks read by every batch (cache/window_misses.py, where counts
        are on the host), so totals are exact between windows and per-batch history lags up to a window."""
        ended = [n for loc, n in self._window_admits if loc is not keep]
        self._window_admits = [(loc, n) for loc, n in self._window_admits if loc is keep]
        for n in ended:
            self.bump_stats(window_misses=n)

    def _wait_for_window_rows(self) -> bool:
        """A forward the prefetch pipeline did not announce, while a window transfer runs on a side stream: its
        misses may read host rows that the transfer is writing back, so it waits for the transfer. Returns
        whether this forward is the announced one of a batch inside an admitted window (all its ids resident)."""
        announced = self.window_forwards_left > 0
        if announced:
            self.window_forwards_left -= 1
            self._start_deferred()
        else:
            self.settle()
        return announced and self._window_active

    def admit_window(self, uniq: torch.Tensor, policy: Policy, next_use: SlotNextUse | None = None,
                     now: int = 0) -> WindowPlan:
        """Admit a look-ahead window's distinct ids (ascending, at most `capacity`) in one batched transfer and
        protect exactly them until the next window replaces the protection (synchronous, in stream order).

        `next_use` (the next known use of each slot's id, see `SlotNextUse`) feeds the policy; `now` is the
        batch number the window starts at.
        """
        self._end_windows()
        self._drop_protection()
        plan = self.plan_window(uniq, policy, next_use, now)
        self.transfer_window(plan)
        self.activate_window(plan)
        return plan

    def plan_window(self, uniq: torch.Tensor, policy: Policy, next_use: SlotNextUse | None = None,
                    now: int = 0, counter: int | None = None) -> WindowPlan:
        """Decide where a window's ids go: victims never come from protected slots (the window in use), slot
        metadata and the index change now, in stream order; the row copies are left to `transfer_window`.
        The window's slots are protected at once, so nothing else evicts them meanwhile. `counter`: the batch
        counter the admitted rows' last use is set to (default: the current one)."""
        start = time.perf_counter()
        if self.host_fence is not None:
            self.host_fence(uniq)
        uniq = uniq.to(device=self.device, dtype=torch.int64, non_blocking=True)
        n = uniq.numel()
        if n > self.capacity:
            raise ValueError(f"a window of {n} distinct ids cannot be resident in a cache of {self.capacity}")
        if not self._planning_in_background():  # a background plan's generation moves on when the training thread takes it
            self.generation += 1
        if next_use is not None:
            refresh = time.perf_counter()
            self._set_next_use(next_use, now)
            self.seconds["next_use_refresh"] += time.perf_counter() - refresh
        n_uniq = torch.full((1,), n, dtype=torch.int64, device=self.device)
        loc_u, _, _, n_miss, move = self._place(uniq, n_uniq, policy, transfer=False, window=True,
                                                counter=self.batch_counter if counter is None else counter)
        self.bump_stats(windows=torch.ones(1, dtype=torch.int64, device=self.device), window_rows_in=n_miss)
        if move is not None and counts_on_host(self.device):
            if self.window_misses is None:
                self.window_misses = WindowMisses(self.capacity, self.device)
            self.window_misses.admitted(move.miss_dest, move.n_miss, by_window=True)
        elif move is not None:  # under the CUDA rules, counted when the window ends (a launch per window)
            self._window_admits.append((loc_u, move.n_admit))
        self._protect(loc_u)
        self._windows.append(loc_u)
        self.seconds["admit_window"] += time.perf_counter() - start
        return WindowPlan(loc_u, move)

    def _set_next_use(self, next_use: SlotNextUse, now: int) -> None:
        """The policy's `next_use` (batches from `now` to each slot's next use, -1 for none) from a snapshot: as
        it is where no slot changed since (counts on the host), else O(cache) elementwise, once per window (a
        slot whose id changed since the snapshot counts as unused)."""
        if next_use.now != now:
            raise ValueError(f"next uses counted from batch {next_use.now} given for a window at batch {now}")
        c = self.capacity
        host = counts_on_host(self.device)
        if host and next_use.epoch == self.slot_epoch and next_use.uses.device == self.device \
                and next_use.uses.shape == (c,) and next_use.uses.dtype == torch.int64:
            self.next_use = next_use.uses
            return
        ids = next_use.ids.to(self.device, non_blocking=True)
        uses = next_use.uses.to(self.device, non_blocking=True)
        known = (self.slot_ids[:c] == ids) & (uses >= 0)
        self.next_use = torch.where(known, uses, torch.full_like(uses, -1))
        # Only rows used since the last refresh have a later next use now (a lower score): the last windows'
        # rows, which joined the pool when their protection came off. Every other score stays or rises.
        if not counts_on_host(self.device):
            self.victim_pool.invalidate()

    def snapshot_slot_ids(self):
        """(host copy of the slot ids, CUDA event after which it is complete, or None): taken without blocking,
        in stream order, for next uses computed off the training thread (`slot_epoch` then says whether they
        changed since)."""
        ids = self.slot_ids[: self.capacity]
        if self.device.type != "cuda":
            return ids.clone(), None
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return host, event

    def transfer_window(self, plan: WindowPlan, stream=None) -> None:
        """Move a planned window's rows. With a CUDA `stream`, the copies run there after everything issued so
        far on the current stream (the last backward included), overlapping later compute; `plan.done` records
        their end. Without one they run in order on the current stream (or at once on CPU)."""
        if plan.move is None:
            return
        # The admitted rows' counts land now, after the planning: a ranking in between may have left their slots
        # out. Where counts are on the host the copies run right after the planning (no ranking in between), and
        # the slots are protected until they join the pool when the window ends.
        if not counts_on_host(self.device):
            self.victim_pool.invalidate()
        if stream is None:
            self._move_rows(plan.move)
            return
        if self.device.type != "cuda":
            # A host thread (`stream.submit`) copies while this thread computes: the copies touch only the victims'
            # slots and host rows and the window's new rows, never the slots or rows of the window in use. They
            # start with the next announced forward, after its module counted who holds the host table (a copy in
            # flight holds views of it too), and are waited for when the window is activated.
            self._deferred = (plan, stream)
            return
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self._move_rows(plan.move)
        # The copies read and write these from the side stream: keep their memory from being reused early.
        for t in plan.move.tensors() + (self.rows.data, self.slot_freq) + tuple(self.states.values()):
            t.record_stream(stream)
        plan.done = torch.cuda.Event()
        plan.done.record(stream)
        self._pending = plan.done

    def activate_window(self, plan: WindowPlan) -> None:
        """Make the current stream wait for the window's rows, then protect exactly that window (O(windows), once
        per window: `seconds["window_protect"]`); nothing to change if it is the only window protected."""
        start = time.perf_counter()
        if self._deferred is not None and self._deferred[0] is plan:  # no forward came to start it: copy now
            self._deferred = None
            self._move_rows(plan.move)
        if plan.done is not None:
            self._await_transfer(plan.done)
            if self._pending is plan.done:
                self._pending = None
        others = [loc for loc in self._windows if loc is not plan.loc_u]
        self._end_windows(keep=plan.loc_u)
        if others:
            if counts_on_host(self.device):
                # O(windows), not O(cache): the other windows' slots join the pool, every window's protection
                # comes off (the protected slots are theirs), then exactly this window's are protected and counted
                self.victim_pool.include(torch.cat(others), True)
                for loc in self._windows:
                    self._set_protection(loc, False)
                self._n_protected = torch.zeros(1, dtype=torch.int64, device=self.device)
            else:  # on a device, fewer launches: clear and recount the whole mask
                self._drop_protection()
            self._protect(plan.loc_u)
            self._windows = [plan.loc_u]
        self._window_active = True  # the pipeline's batches up to the next window are all hits
        self.seconds["window_protect"] += time.perf_counter() - start

    def plan_in_background(self, run, worker) -> BackgroundPlan:
        """Leave a window's planning and row moves to `run` (returns the WindowPlan it made and moved, or None) on
        the host thread `worker`, started by the next announced forward as a deferred copy is (a CPU cache with
        counts on the host, its window fitting beside the one in use). Meanwhile the training thread runs the
        current window's batches: all hits on protected slots, whose rows and metadata the plan never touches
        (it chooses victims among unprotected slots and serves no row from the host). Its counter bumps are
        held until `take_background`, the generation moves on there."""
        bg = BackgroundPlan(None)

        def planned():
            _PLANNING.cache, _PLANNING.stats = self, bg.stats
            try:
                bg.plan = run()
            finally:
                _PLANNING.cache = _PLANNING.stats = None

        bg.run = planned
        self._deferred = (bg, worker)
        self._background = bg
        return bg

    def take_background(self, bg: BackgroundPlan) -> WindowPlan | None:
        """At the planned window's start, on the training thread: the plan, made here if no forward started it,
        else waited for (its error raised here); its counter bumps added."""
        if self._deferred is not None and self._deferred[0] is bg:
            self._deferred = None
            bg.run()
        if bg.done is not None:
            self._await_transfer(bg.done)
            if self._pending is bg.done:
                self._pending = None
        self._absorb_background()
        self.generation += 1  # the window's locations are new to the batches that follow
        return bg.plan

    def drop_background(self) -> None:
        """A prefetch loop ending: a window to be planned in the background that no forward started is dropped
        (it changed nothing yet; making it now would only admit rows for a window that never comes)."""
        if self._deferred is not None and isinstance(self._deferred[0], BackgroundPlan):
            self._deferred = None
            self._background = None

    def _absorb_background(self) -> None:
        """The counter bumps of a background plan that ran to its end (training thread)."""
        bg, self._background = self._background, None
        if bg is not None:
            stats, bg.stats = bg.stats, []
            for values in stats:
                self.bump_stats(**values)

    def copying_on_host(self) -> bool:
        """Whether a host thread is moving a window's rows now (CPU overlap): it holds views of the host table."""
        return isinstance(self._pending, Future) and not self._pending.done()

    def _start_deferred(self) -> None:
        if self._deferred is not None:
            (plan, worker), self._deferred = self._deferred, None
            if isinstance(plan, BackgroundPlan):
                plan.done = worker.submit(plan.run, pause=False)
            else:
                plan.done = worker.submit(self._move_rows, plan.move)
            self._pending = plan.done

    def _await_transfer(self, done) -> None:
        """Order what follows after a window transfer: the current stream waits for a side stream's event (no
        host sync); a host thread's copies are waited for (their error, if any, raised here)."""
        if isinstance(done, Future):
            start = time.perf_counter()
            done.result()
            self.seconds["transfer_wait"] += time.perf_counter() - start
        else:
            torch.cuda.current_stream(self.device).wait_event(done)

    def settle(self) -> None:
        """Wait for a window transfer in flight before anything that reads or writes rows, counts or host rows
        beyond the window in use (a flush, a reload, an unannounced forward, counts halved, ...)."""
        if self._deferred is not None:
            (plan, _), self._deferred = self._deferred, None
            if isinstance(plan, BackgroundPlan):
                plan.run()
            else:
                self._move_rows(plan.move)
        if self._pending is not None:
            done, self._pending = self._pending, None
            try:
                self._await_transfer(done)
            except BaseException:
                self._background = None  # a background plan that failed: nothing of it to count
                raise
        self._absorb_background()

    def _resident_or_dump(self, loc: torch.Tensor) -> torch.Tensor:
        """Cache slots of `loc`; host locations and -1 go to the trailing dump element (two launches: negative
        locations clamp to -1, which the remainder sends to C)."""
        return loc.clamp(-1, self.capacity).remainder(self.capacity + 1)

    def release_window(self) -> None:
        """Drop window protection (the pipeline ended); rows still in flight are waited for in stream order."""
        self.settle()
        self._end_windows()
        self._drop_protection()
        self.window_misses = None  # rows admitted for batches that never ran count as neither hits nor misses

    @property
    def cache_rows(self) -> int:
        """The rows the cache holds resident at each prefetch window's start: `capacity` less the staging slots."""
        return self.capacity - self.staging_rows

    def reserve_staging(self, rows: int) -> None:
        """At least `rows` staging slots beyond `cache_rows`, allocated once, never shrunk (cache/staging.py)."""
        staging.reserve(self, rows)

    def trim_resident(self, policy: Policy) -> None:
        """Evict the lowest-scored unprotected rows back to `cache_rows` resident (cache/staging.py)."""
        staging.trim(self, policy)

    def _drop_protection(self) -> None:
        """Unprotected slots fall back to their real scores, which may be below the victim pool's bound: they
        join the pool (where counts are on the host; else the pool is invalidated)."""
        if self._windows:
            self.victim_pool.include(torch.cat(self._windows), counts_on_host(self.device))
        self._windows = []
        self._window_active = False
        self.protected.zero_()
        self._n_protected.zero_()

    def _protect(self, loc: torch.Tensor) -> None:
        """Protect a window's slots (`loc`: its distinct ids' locations; host locations go to the dump element)
        and count the protected slots: where counts are on the host by adding the newly protected ones (O(window),
        not O(cache)); on a device by one sum over the mask (two launches instead of six)."""
        if not counts_on_host(self.device):
            self.protected.index_fill_(0, self._resident_or_dump(loc), True)
            self._n_protected = self.protected[: self.capacity].sum().reshape(1)
            return
        self._n_protected = (self._n_protected + self._set_protection(loc, True)).reshape(1)

    def _set_protection(self, loc: torch.Tensor, value: bool):
        """Set the protection of a window's slots (host locations: the dump element) where counts are on the
        host; returns how many resident slots changed. One C pass where the C library is installed, else torch ops."""
        c = place_native.NATIVE.get()
        changed = None if c is None else place_native.set_protection(c, self.protected, loc, self.capacity, value)
        if changed is None:
            slots = self._resident_or_dump(loc)
            changed = ((take(self.protected, slots) != value) & (slots < self.capacity)).sum()
            self.protected.index_fill_(0, slots, value)
        return changed

    def _slot_view(self, slots: torch.Tensor | None, protected: torch.Tensor) -> SlotView:
        """The policy's view of `slots` (None: all C slots) under the protection mask `protected` (of them)."""
        c = self.capacity
        if slots is None:
            return SlotView(self.slot_ids[:c], self.slot_freq[:c], self.slot_last_use[:c], self.next_use,
                            protected, self._table_rank())
        return SlotView(take(self.slot_ids, slots), take(self.slot_freq, slots), take(self.slot_last_use, slots),
                        take(self.next_use, slots), protected, self._table_rank(slots), slots, c)

    def _score_all(self, policy: Policy, protected: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Every slot's score under `protected`: one gated launch for a built-in policy on the Triton backend
        (no work while `gate` reads 0), else the policy over the full view."""
        kind = score_kernel(policy)
        if kind is None or kernels.backend_for(self.device) != "triton":
            return self._score_slots(policy, None, protected)
        c = self.capacity
        tables = None if self.table_starts is None else (self.table_starts, self.table_ranks)
        return kernels.slot_score_triton(kind, self.slot_ids[:c], self.slot_freq[:c], self.slot_last_use[:c],
                                         self.next_use, protected, tables, gate)

    def _score_slots(self, policy: Policy, slots: torch.Tensor | None, protected: torch.Tensor) -> torch.Tensor:
        """`policy`'s scores of `slots` (None: all C) under `protected` (one per entry): the policy over the view."""
        return policy(self._slot_view(slots, protected))

    def _rescore_pool(self, policy: Policy, pool: torch.Tensor, joined: torch.Tensor, bound: int, mark: torch.Tensor,
                      scratch: torch.Tensor, drop_protected: bool = False):
        """The victim pool's re-scoring in one C pass for a built-in policy of a one-table cache on the host-count
        path (VictimPool.choose's `rescore`), else None."""
        if not counts_on_host(self.device) or getattr(self, "table_starts", None) is not None:
            return None
        return pool_native.rescore(pool_native.kind(policy), pool, joined, self.capacity, self.slot_ids,
                                   self.slot_freq, self.slot_last_use, self.next_use, self.protected, bound, mark,
                                   scratch, drop_protected)

    def _place(self, uniq, n_uniq, policy: Policy, transfer: bool = True, window: bool = False,
               counter: int | None = None):
        """Find or admit each of the first n_uniq ids of `uniq`; returns (loc_u, live, n_hit, n_miss, move).

        Protected slots and this set's hits are never victims; misses beyond the free slots are served from
        the host (loc = HOST_LOC - id). With `transfer=False` the row copies are returned (`move`) instead of
        done; the slot metadata is updated either way. `window`: a prefetch window's placement, whose slots (hits
        included) are protected right after, so the victim pool may drop protected candidates. Under the CUDA
        rules this is cachedemb/cache/device_place.py's fixed launch sequence (the same victims in the same
        order). `counter`: the batch counter admitted rows take as their last use (default: the current one)."""
        self.slot_epoch += 1
        counter = self.batch_counter if counter is None else counter
        if not self._early_exit():
            sizes, bufs = device_place.batch(self, policy, uniq.numel(), with_unique=False)
            loc_u, n_hit, n_miss, move = device_place.place_batch(self, uniq, n_uniq, policy, bufs, sizes)
            move = RowMove(*move)
            if transfer:
                self._move_rows(move)
            return loc_u, torch.arange(uniq.numel(), device=self.device) < n_uniq, n_hit, n_miss, move
        dev = self.device
        cap = uniq.numel()
        early = self._early_exit()
        id_slot = self._use_map()
        c = place_native.NATIVE.get() if dev.type == "cpu" else None
        if c is not None and place_native.fits(id_slot, self.protected, self.slot_ids, self.dirty, self.slot_last_use):
            placed = self._place_native(c, uniq, n_uniq, policy, transfer, id_slot, window, counter)
            if placed is not None:
                return placed
        live = torch.arange(cap, device=dev) < n_uniq
        slot = torch.where(live, take(id_slot, uniq.clamp(min=0)).to(torch.int64), -1)
        is_hit = live & (slot >= 0)
        is_miss = live & (slot < 0)
        n_hit = is_hit.sum().reshape(1)
        n_miss = is_miss.sum().reshape(1)

        # This batch's hits are protected too, in place while victims are chosen (O(hits); restored after),
        # counted past the window's.
        hit_slots = torch.where(is_hit, slot, torch.full_like(slot, self.capacity))
        was = take(self.protected, hit_slots)
        newly = is_hit & was.logical_not()
        n_free = (self.capacity - self._n_protected - newly.sum()).reshape(1)
        self.protected.index_fill_(0, hit_slots, True)
        n_admit = torch.minimum(n_miss, n_free)
        miss_count = self._on_host(n_miss, cap)
        victims = self._choose_victims(policy, cap, early, n_hit, n_miss, n_admit, hit_slots, was, lambda: newly,
                                       window)
        self.protected.index_put_((hit_slots,), was)

        # Rank the misses; rank r < n_admit takes victim r, the rest are served from the host.
        rank = torch.cumsum(is_miss, 0) - 1
        overflow = kernels.host_loc(uniq)
        if victims is not None:
            k = victims.numel()
            from_victim = take(victims, rank.clamp(min=0, max=k - 1))
            dest = torch.where(rank < n_admit, from_victim, overflow)
        else:
            dest = torch.full_like(rank, -1)
        loc_u = torch.where(is_hit, slot, torch.where(is_miss, dest, torch.full_like(slot, -1)))
        move = None
        if miss_count > 0:
            # The map first: the evicted ids out, then the admitted ones in (every one finds its place).
            old_ids = take(self.slot_ids, victims)
            used = torch.arange(k, device=dev) < n_admit
            id_slot.index_fill_(0, old_ids.masked_select(used & (old_ids >= 0)), -1)
            admitted = is_miss & (dest >= 0)
            id_slot.index_put_((uniq.masked_select(admitted),), dest.masked_select(admitted).to(torch.int32))
            self.bump_stats(rows_in=n_admit, host_rows=n_miss - n_admit)
            rank_slot = torch.where(is_miss, rank, torch.full_like(rank, cap))
            miss_ids = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
            miss_dest = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
            miss_ids.index_put_((rank_slot,), uniq)
            # Host-served misses get no slot (-1): no copy, no metadata.
            miss_dest.index_put_((rank_slot,), torch.where(dest >= 0, dest, torch.full_like(dest, -1)))
            dirty_ids = torch.where(take(self.dirty, victims) & (old_ids >= 0), old_ids, torch.full_like(old_ids, -1))
            evicted = ((old_ids >= 0) & used).sum().reshape(1)
            written = ((dirty_ids >= 0) & used).sum().reshape(1)
            move = RowMove(victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss)
            if transfer:
                self._move_rows(move)
            self._masked_put(self.slot_ids, victims, torch.full_like(victims, -1), n_admit)
            self._masked_put(self.dirty, victims, torch.zeros_like(victims, dtype=torch.bool), n_admit)
            self._masked_put(self.slot_ids, miss_dest, miss_ids, n_miss)
            self._masked_put(self.dirty, miss_dest, torch.zeros_like(miss_dest, dtype=torch.bool), n_miss)
            # Admission counts as a use for recency (else a row would inherit its victim's last use).
            self._masked_put(self.slot_last_use, miss_dest, torch.full_like(miss_dest, counter), n_miss)
            self.bump_stats(evictions=evicted, rows_out=written)
        return loc_u, live, n_hit, n_miss, move

    def _place_native(self, c, uniq, n_uniq, policy: Policy, transfer: bool, id_slot, window: bool,
                      counter: int):
        """_place on the host-count path with its bookkeeping in C (cachedemb/cache/place_native.py): the same
        victims, writes and results as the torch code above; None (nothing changed) where an id lies outside the
        map, for the torch code to refuse."""
        n = int(n_uniq)
        cap = uniq.numel()
        found = place_native.find(c, uniq, n, id_slot, self.capacity, self.protected)
        if found is None:  # an id outside the map: the torch code raises as it always did
            return None
        n_hit = torch.tensor([found.n_hit], dtype=torch.int64)
        n_miss = torch.tensor([found.n_miss], dtype=torch.int64)
        n_free = self.capacity - int(self._n_protected) - found.n_newly
        admit = min(found.n_miss, n_free)
        n_admit = torch.tensor([admit], dtype=torch.int64)

        def newly():
            return (found.hit_slots < self.capacity) & found.was.logical_not()

        victims = self._choose_victims(policy, cap, True, n_hit, n_miss, n_admit, found.hit_slots, found.was, newly,
                                       window)
        loc_u, old_ids, dirty_ids, miss_ids, miss_dest, evicted, written = place_native.commit(
            c, found, self.protected, victims, admit, self.capacity, id_slot, self.slot_ids, self.dirty,
            self.slot_last_use, counter)
        live = torch.arange(cap) < n
        move = None
        if victims is not None:
            self.bump_stats(rows_in=n_admit, host_rows=n_miss - n_admit)
            move = RowMove(victims, n_admit, old_ids, dirty_ids, miss_ids, miss_dest, n_miss)
            if transfer:
                self._move_rows(move)
            self.bump_stats(evictions=torch.tensor([evicted]), rows_out=torch.tensor([written]))
        return loc_u, live, n_hit, n_miss, move

    def _choose_victims(self, policy: Policy, cap: int, early: bool, n_hit, n_miss, n_admit, hit_slots, was, newly,
                        window: bool = False):
        """This batch's victims (None without misses), its hits protected in `self.protected` meanwhile;
        `newly()` gives the hits whose protection is this batch's own ([cap] bool)."""

        def protected(slots):
            return self.protected[: self.capacity] if slots is None else take(self.protected, slots)

        def unprotect_hits(score):
            """A full ranking's scores with the hits' protection taken off again (what they score later)."""
            at = hit_slots.clamp(max=self.capacity - 1)
            own = self._score_slots(policy, at, was)
            score.scatter_reduce_(0, at, torch.where(newly(), own, torch.full_like(own, PROTECTED)), "amin")

        miss_count = self._on_host(n_miss, cap)
        if not self._planning_in_background():
            # the forward gathers the host-served rows (at most the misses) there; a background window plan serves
            # none (its window fits beside the one in use) and must not move the rows the training thread uses
            self._reserve_spare(miss_count)
        if miss_count <= 0:
            return None
        k = max(1, min(miss_count, self.capacity))
        ranked = self.victim_pool.rankings
        rank_start = time.perf_counter()
        victims = self.victim_pool.choose(policy, self._slot_view, unprotect_hits, protected, k,
                                          n_admit, self._on_host(n_hit, cap), early, self._score_all,
                                          score_of=self._score_slots, rescore=self._rescore_pool,
                                          drop_protected=window and early)
        if not early:
            self.victim_pool.observe(n_miss)  # sizes the pool from misses that reached the host
        if self.victim_pool.rankings != ranked:
            self.seconds["victim_rank"] += time.perf_counter() - rank_start
        return victims

    def _move_rows(self, move: RowMove, add: torch.Tensor | None = None) -> None:
        """Dirty victims (rows, state) and every victim's count to the host, then the missing rows in (their counts
        + `add`, the batch's own lookups, when given): one launch."""
        kernels.row_move(self._row_tensors(), self.slot_freq, self.host_freq, move.victims, move.n_admit,
                         move.old_ids, move.dirty_ids, move.miss_ids, move.miss_dest, move.n_miss, add)

    def mark_dirty(self, plan: BatchPlan, marked: bool = False) -> None:
        """The plan's device rows were written (host-served rows were written in place on the host); `marked`: the
        writer set their dirty bits itself (the fused backward does)."""
        self.maybe_dirty = True
        if marked:
            return
        live = (torch.arange(plan.loc_u.numel(), device=self.device) < plan.n_uniq) & (plan.loc_u >= 0)
        self.dirty.index_fill_(0, torch.where(live, plan.loc_u, torch.full_like(plan.loc_u, self.dump)), True)

    def write_through(self, plan: BatchPlan) -> None:
        """Write the plan's resident rows (and state) back to the host now and mark them clean: O(batch). For an
        owner whose host table may be written by someone else before the next forward."""
        live = (torch.arange(plan.loc_u.numel(), device=self.device) < plan.n_uniq) & (plan.loc_u >= 0)
        slots = torch.where(live, plan.loc_u, torch.full_like(plan.loc_u, self.dump))
        self.bump_stats(rows_out=self._write_back(slots, plan.n_uniq))
        self.dirty.index_fill_(0, slots, False)

    # ----------------------------------------------------------------- whole-cache operations
    def flush(self) -> None:
        """Write every dirty row (and its state) back to the host; the cache keeps its contents."""
        self.settle()
        start = time.perf_counter()
        slots = torch.arange(self.total_slots, device=self.device)
        written = self._write_back(slots, self.total_slots)
        self.bump_stats(rows_out=written)
        self.dirty.zero_()
        self.maybe_dirty = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds["flush"] += time.perf_counter() - start

    def reload(self) -> None:
        """Re-read every resident row from the host (after the host table was replaced); nothing is dirty.
        Spill rows are dropped, so a batch planned before this can no longer run its backward."""
        self.settle()
        self.generation += 1
        self.slot_epoch += 1
        slots = torch.arange(self.capacity, device=self.device)
        ids = self.slot_ids[: self.capacity]
        self.slot_ids[self.capacity:] = -1
        self.dirty.zero_()
        self.maybe_dirty = False
        self._fill(ids, slots, self.capacity)
        self.victim_pool.invalidate()  # counts re-read from the host

    def refresh(self, plan: BatchPlan) -> None:
        """Re-read the rows of the plan's resident ids from the host table (O(batch)): for a caller whose host
        table is the truth and may have been written since the rows were admitted."""
        live = (torch.arange(plan.loc_u.numel(), device=self.device) < plan.n_uniq) & (plan.loc_u >= 0)
        src = torch.where(live, plan.uniq, torch.full_like(plan.uniq, -1))
        kernels.row_copy(self.host_weight, src, self.rows, plan.loc_u, plan.n_uniq)

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Cache slot of each id (-1 if not resident or out of range), by the id index: O(len(ids)), no host
        sync (the host map on the host-count path)."""
        ids = ids.to(device=self.device, dtype=torch.int64)
        if self._early_exit():
            valid = (ids >= 0) & (ids < self.num_rows)
            found = take(self._use_map(), torch.where(valid, ids, 0)).to(torch.int64)
            return torch.where(valid, found, -1)
        self._use_hash()
        n = torch.full((1,), ids.numel(), dtype=torch.int64, device=self.device)
        return kernels.index_lookup(self.index_keys, ids, n, False)

    def reread_rows(self, ids: torch.Tensor) -> None:
        """After the host rows `ids` (weight, optimizer state, count) were rewritten by their owner: overwrite
        the resident copies from the host and clear their dirty bits, so no stale copy is read or written back."""
        self.settle()
        ids = ids.to(device=self.device, dtype=torch.int64)
        if ids.numel() == 0:
            return
        slots = self.slots_of(ids)
        resident = slots >= 0
        self._fill(torch.where(resident, ids, -1), slots, ids.numel())
        self.dirty.index_fill_(0, torch.where(resident, slots, self.dump), False)
        self.victim_pool.invalidate()  # counts re-read from the host may be lower

    def drop_rows(self, ids: torch.Tensor) -> None:
        """Before the host rows `ids` are given to other ids by their owner (a host tier in front): write the
        resident copies back (rows and state if dirty, counts always) and empty their slots. O(len(ids))."""
        self.settle()
        self.slot_epoch += 1
        ids = ids.to(device=self.device, dtype=torch.int64)
        if ids.numel() == 0:
            return
        slots = self.slots_of(ids)
        resident = slots >= 0
        slots = torch.where(resident, slots, torch.full_like(slots, self.dump))
        n = torch.full((1,), ids.numel(), dtype=torch.int64, device=self.device)
        self.bump_stats(rows_out=self._write_back(slots, n), evictions=resident.sum().reshape(1))
        if self._live_index == "map":
            self.id_slot.index_fill_(0, ids.masked_select(resident), -1)
        else:
            kernels.index_delete(self.index_keys, torch.where(resident, ids, torch.full_like(ids, -1)), ids.numel(),
                                 self._early_exit())
        self.slot_ids.index_fill_(0, slots, -1)
        self.dirty.index_fill_(0, slots, False)
        self._n_protected -= (resident & take(self.protected, slots)).sum().reshape(1)
        self.protected.index_fill_(0, slots, False)
        # Emptied slots score below the pool's bound: where the count is free to read they join the pool (which
        # stays exact, as after a window's protection is dropped; a full ranking of the cache cost ~3.5 ms a
        # drop on the file tier); under the CUDA rules they wait for the pool's next ranking (victim choice,
        # never results).
        if self._on_host(resident.sum(), 0):
            self.victim_pool.include(slots.masked_select(resident), True)

    def resize_host(self, num_rows: int) -> None:
        """Give the host side `num_rows` rows (the first min(old, new) kept): a host tier in front that needs
        a transient staging area. Every resident row must lie below `num_rows`."""
        self.settle()
        keep = min(num_rows, self.num_rows)
        weight = pinned_empty((num_rows, self.dim), self.dtype)
        weight[:keep].copy_(self.host_weight[:keep])
        self.host_weight = weight
        for name, host in list(self.host_states.items()):
            state = pinned_empty((num_rows, host.shape[1]), host.dtype)
            state[:keep].copy_(host[:keep])
            state[keep:].zero_()
            self.host_states[name] = state
        freq = pinned_empty((num_rows,), torch.int64)
        freq[:keep].copy_(self.host_freq[:keep])
        freq[keep:].zero_()
        self.host_freq = freq
        if num_rows > keep:
            self.host_weight[keep:].zero_()
        if self.id_slot is not None:  # the host map follows the host rows (resident ids lie below keep)
            id_slot = torch.full((num_rows,), -1, dtype=torch.int32)
            id_slot[:keep].copy_(self.id_slot[:keep])
            self.id_slot = id_slot
        self.num_rows = num_rows

    def _readable(self, host_weight: torch.Tensor) -> torch.Tensor:
        """The host table as the row copies read it: a CUDA cache's kernels read host rows in place, which only
        pinned memory allows (the modules hand over pinned tables; a plain one is copied once)."""
        if self.device.type == "cuda" and host_weight.device.type == "cpu" and not host_weight.is_pinned():
            return pinned_copy(host_weight)
        return host_weight

    def replace_host_table(self, host_weight: torch.Tensor) -> None:
        """Adopt a new host table (same shape; its dtype becomes the cache's, optimizer state following the
        accumulation dtype), re-reading every resident row from it. Dirty rows must be flushed first."""
        if tuple(host_weight.shape) != (self.num_rows, self.dim):
            raise ValueError(f"host table must have shape ({self.num_rows}, {self.dim}), "
                             f"got {tuple(host_weight.shape)}")
        self.host_weight = host_weight = self._readable(host_weight)
        if host_weight.dtype != self.dtype:
            self.dtype = host_weight.dtype
            self._set_rows(torch.zeros_like(self.rows, dtype=self.dtype))
            target = state_dtype(self.dtype)
            for name, host in list(self.host_states.items()):
                if host.dtype != target:
                    converted = pinned_empty(tuple(host.shape), target)
                    converted.copy_(host)
                    self.host_states[name] = converted
                    self.states[name] = self.states[name].to(target)
        self.reload()

    def preload(self, ids: torch.Tensor) -> None:
        """Place `ids` (distinct, at most `capacity`) into the first slots of an empty cache."""
        self.settle()
        ids = ids.to(device=self.device, dtype=torch.int64)
        if ids.numel() > self.capacity:
            raise ValueError(f"cannot preload {ids.numel()} rows into a cache of {self.capacity}")
        slots = torch.arange(ids.numel(), device=self.device)
        self._fill(ids, slots, ids.numel())
        self.slot_ids[: ids.numel()] = ids
        self.slot_epoch += 1
        self.victim_pool.invalidate()
        self._rebuild_index()
        self._live_index = "hash"

    def set_tables(self, starts) -> None:
        """Tell the policies which rows belong to which table (ascending first rows, one per table, the first
        0), for caches shared by several tables. Tables are ranked by size, largest first."""
        starts = torch.as_tensor(starts, dtype=torch.int64).reshape(-1)
        if starts.numel() == 0 or int(starts[0]) != 0 or bool((starts[1:] <= starts[:-1]).any()) or \
                int(starts[-1]) >= self.num_rows:
            raise ValueError(f"table starts must ascend from 0 and stay below {self.num_rows} rows, "
                             f"got {starts.tolist()}")
        sizes = torch.diff(starts, append=torch.tensor([self.num_rows]))
        order = torch.argsort(-sizes, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        self.table_starts = starts.to(self.device)
        self.table_ranks = rank.to(self.device)
        self.victim_pool.invalidate()

    def _table_rank(self, slots: torch.Tensor | None = None) -> torch.Tensor | None:
        if getattr(self, "table_starts", None) is None:
            return None
        ids = (self.slot_ids[: self.capacity] if slots is None else take(self.slot_ids, slots)).clamp(min=0)
        table = torch.searchsorted(self.table_starts, ids, right=True) - 1
        return take(self.table_ranks, table)

    def halve_counts(self) -> None:
        """Age every access count (host and cached) by half, so old popularity fades. O(table) on the host,
        once per `freq_halflife` training batches; on CUDA it waits for in-flight copies of the counts."""
        self.settle()
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host_freq.bitwise_right_shift_(1)
        self.slot_freq.bitwise_right_shift_(1)
        self.victim_pool.invalidate()  # halving may reorder equal-after-shift counts
        self.seconds["halve_counts"] += time.perf_counter() - start

    def move_to(self, device: torch.device) -> None:
        """Move the device side; the host table stays where it is (pinned if the target is CUDA)."""
        self.settle()
        device = exact_device(device)
        if device == self.device:
            return
        self.flush()
        self.slot_epoch += 1
        if device.type == "cuda" and not self.host_weight.is_pinned():
            self.host_weight = pinned_copy(self.host_weight)
            self.host_states = {k: pinned_copy(v) for k, v in self.host_states.items()}
            self.host_freq = pinned_copy(self.host_freq)
        self.device = device
        self._set_rows(self.rows.data.to(device))
        for name in ("slot_ids", "slot_freq", "slot_last_use", "dirty", "next_use", "protected", "hit_mark",
                     "_n_protected", "index_keys", "index_slots", "index_used", "stats", "history", "unread_ahead"):
            setattr(self, name, getattr(self, name).to(device))
        for name in ("table_starts", "table_ranks"):
            if getattr(self, name, None) is not None:
                setattr(self, name, getattr(self, name).to(device))
        self.states = {k: v.to(device) for k, v in self.states.items()}
        self.victim_pool.to(device)

    def victim_pool_bytes(self) -> int:
        """Bytes of the victim pool's candidates, bound and union mark, and the window's protected count."""
        return sum(t.numel() * t.element_size() for t in self.victim_pool.tensors() + [self._n_protected])

    def row_bytes(self) -> int:
        return self.dim * self.host_weight.element_size() + sum(
            t.shape[1] * t.element_size() for t in self.host_states.values())

    def stats_dict(self) -> dict[str, int | float]:
        """The counters as host ints (a host sync on CUDA), rows a window admitted counted as misses, and
        `hit_rate` (CachedEmbeddingBag.cache_stats says what each one counts)."""
        values = window_rows_as_misses(dict(zip(STAT_NAMES, self.stats.tolist())))
        values["hit_rate"] = hit_rate(values["hits"], values["unique"])
        values["bytes_in"] = values["rows_in"] * (self.row_bytes() + 8)
        values["bytes_out"] = values["rows_out"] * self.row_bytes()
        return values

    def distinct_peak(self) -> int:
        """The most distinct ids one batch placed under the CUDA rules looked up, among the counts that already
        reached the host without a sync (cache/miss_estimate.py); 0 before any."""
        return self.victim_pool.misses.distinct_peak

    def timing_dict(self) -> dict:
        """Host seconds spent in cache operations (on CUDA: issuing them; they run asynchronously), under the
        readable names of SECONDS (nested: the prefetch pipeline's stages under "prefetch")."""
        return named_seconds(SECONDS, self.seconds)

    def history_dict(self) -> dict[str, list[int]]:
        """Per-batch counters of the last `history` batches, oldest first (a host sync on CUDA). Window
        admissions count in the batch that follows them."""
        size = self.history.shape[0]
        kept = min(size, self.history_batches)
        if kept == 0:
            return {name: [] for name in ("batch",) + STAT_NAMES}
        first = self.history_batches - kept
        order = [(first + i) % size for i in range(kept)]
        cumulative = self.history[order].cpu()
        if first == 0:
            previous = torch.cat([torch.zeros(1, len(STAT_NAMES), dtype=torch.int64), cumulative[:-1]])
            deltas, batches = cumulative - previous, list(range(kept))
        else:
            deltas, batches = cumulative[1:] - cumulative[:-1], list(range(first + 1, self.history_batches))
        out = {"batch": batches}
        out.update(window_rows_as_misses({name: deltas[:, i] for i, name in enumerate(STAT_NAMES)}))
        return {k: v if k == "batch" else v.tolist() for k, v in out.items()}

    def reset_stats(self) -> None:
        # a window planned in the background before the reset counts before it, as one planned inline would
        self.settle()
        self._window_admits = []  # a window under way: its rows' hits may predate the reset, so no misses either
        self.stats.zero_()
        self.history.zero_()
        self.history_batches = 0
        self.seconds = dict.fromkeys(self.seconds, 0.0)
