"""`Prefetcher`: the training thread's side of the pipeline (stages, threads and hazards: the package docstring)."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import CancelledError, Future
from typing import Callable, Iterable, Iterator, Sequence

import torch

from cachedemb.cache.ahead import AheadBatch, accepts_ahead
from cachedemb.cache.embedding_cache import BackgroundPlan, EmbeddingCache, SlotNextUse
from cachedemb.cache.sync_mode import counts_on_host
from cachedemb.cache.policy import Policy, resolve
from cachedemb.prefetch.device_read_ahead import DeviceReadAhead
from cachedemb.prefetch.ids_check import IdsMismatchCheck
from cachedemb.prefetch.overlap import (CURRENT, NONE, SIDE, CopyLog, WindowDecision, fits_beside, staging_rows_for,
                                        to_device)
from cachedemb.prefetch.read_ahead import ReadAhead, ReadAheadBase, Worker
from cachedemb.prefetch.windows import WindowInfo

IdsFn = Callable[[object], Sequence[torch.Tensor]]

# A batch's forward unique is asked for this many batches before it is yielded. It is urgent, but waits for the
# read-ahead task running then: at 2, a depth-4 window's third batch often found it behind the window's next-use
# query (~13 ms at a 5% cache) and computed its unique ids and placement itself (10 of 40 batches, ~3 ms each).
UNIQUE_LEAD = 3
SPAN_SLACK = 2  # batches of uses kept beyond the read-ahead distance


def read_ahead_on_device(caches: list[EmbeddingCache]) -> bool:
    """Whether the read-ahead's id work runs on the caches' devices (device_read_ahead.py): CACHEDEMB_READ_AHEAD
    = "device" or "host" says; by default on the GPU when every cache is on one (a GPU step is shorter than the
    host's id work on a batch), on the host for CPU caches (which take the forward hand-off it offers)."""
    choice = os.environ.get("CACHEDEMB_READ_AHEAD", "").strip().lower()
    if choice not in ("", "host", "device"):
        raise ValueError(f"CACHEDEMB_READ_AHEAD={choice!r}: expected 'host' or 'device' (or unset)")
    if choice:
        return choice == "device"
    return bool(caches) and all(c.device.type == "cuda" for c in caches)


def describe_module(modules: Sequence, i: int) -> str:
    """`modules[i] (CachedEmbeddingBag(1000, 16, mode='sum'))`: how an error or warning names a module."""
    text = " ".join(repr(modules[i]).split())
    return f"modules[{i}] ({text if len(text) <= 120 else text[:117] + '...'})"


def check_prefetchable(modules: Sequence) -> None:
    """Refuse, before anything is read, a module whose ids the pipeline cannot read (no `prefetch_targets`: a
    plain nn.EmbeddingBag, say), naming it."""
    for i, module in enumerate(modules):
        if not callable(getattr(module, "prefetch_targets", None)):
            raise TypeError(f"cachedemb.prefetch cannot prefetch {describe_module(modules, i)}: it has no cache "
                            "(expected a cachedemb CachedEmbeddingBag, CachedEmbeddingBagCollection or a model "
                            "shard() returned); leave it out of the modules list")


def refuse_ambiguous_default(modules: Sequence, batch) -> None:
    """Several single-table modules would all read the same input of `batch` (its first element, its "input"),
    so each would prefetch another's ids: refused with the `ids=` to pass instead."""
    positional = [i for i, m in enumerate(modules) if getattr(m, "reads_batch_by_position", False)]
    if len(positional) < 2:
        return
    if isinstance(batch, (tuple, list)):
        shape = f"a {type(batch).__name__} of {len(batch)}"
        example = "ids=lambda batch: [" + ", ".join(f"batch[{k}]" for k in range(len(positional))) + "]"
    elif isinstance(batch, dict):
        shape = f"a dict with keys {sorted(map(str, batch))}"
        example = "ids=lambda batch: [" + ", ".join(f"batch['ids_{k}']" for k in range(len(positional))) + "]"
    else:
        shape = f"a {type(batch).__name__}"
        example = "ids=lambda batch: [ids_for_module_0, ids_for_module_1, ...]"
    names = ", ".join(describe_module(modules, i) for i in positional)
    raise ValueError(f"cachedemb.prefetch cannot tell which ids of the batch ({shape}) feed which of {names}: "
                     f"each would read the batch's first input. Pass one id tensor per module, in the order of "
                     f"modules, e.g. {example}")


def default_ids(module, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
    """(cache, ids in that cache's row space) of a module for a batch: `module.prefetch_targets(batch)`."""
    return list(module.prefetch_targets(batch))


class WindowCopier:
    """The host thread that plans a CPU window and moves its rows during compute; the read-ahead starts no ordered
    task meanwhile (the next window waits for the copy, the read-ahead has slack). A forward's unique ids still
    start: a forward is about to take them, and one that finds them not ready computes them itself, with its
    placement (~3 ms at a 5% cache)."""

    def __init__(self, read_ahead: Worker):
        self.read_ahead = read_ahead
        self.worker = Worker(name="cachedemb-window-copy")

    @contextmanager
    def pausing(self):
        """The read-ahead starts no ordered task inside (a task that waits for the read-ahead waits outside)."""
        self.read_ahead.pause()
        try:
            yield
        finally:
            self.read_ahead.resume()

    def _run(self, fn, args):
        with self.pausing():
            return fn(*args)

    def submit(self, fn, *args, pause: bool = True) -> Future:
        return self.worker.submit(self._run, fn, args) if pause else self.worker.submit(fn, *args)

    def close(self) -> None:
        self.worker.close()
        self.read_ahead.resume()


class Prefetcher:
    """Iterator over `batches` that keeps the given modules' caches one window ahead (see the package docstring)."""

    def __init__(self, batches: Iterable, modules: Sequence, depth: int = 4, horizon: int = 64,
                 ids: IdsFn | None = None, policy: str | Policy = "lookahead", overlap: bool | None = None,
                 threaded: bool = True, staging_rows: int | float = 0):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (batches admitted together), got {depth!r}")
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < depth:
            raise ValueError(f"horizon must be an int >= depth={depth} (batches whose ids are read ahead), "
                             f"got {horizon!r}")
        if not modules:
            raise ValueError("modules must name at least one CachedEmbeddingBag(-Collection) to prefetch for")
        check_prefetchable(modules)
        if ids is not None and not callable(ids):
            raise TypeError(f"ids must be a function batch -> [one id tensor per module], got {type(ids).__name__}")
        staging_rows_for(staging_rows, 1)  # bad values refused here, before anything is read
        self.staging = staging_rows
        self.source = iter(batches)
        self.modules = list(modules)
        self.depth, self.horizon = depth, horizon
        # Batches read ahead of the one yielded: the horizon of the window planned furthest ahead (two windows
        # out, with overlap) must be read when that window is planned.
        self.read_ahead = horizon + 2 * depth
        self.ids_fn = ids
        self.policy = resolve(policy)
        self.overlap = overlap  # None: on for CUDA caches, and for CPU caches when threaded
        self.threaded = threaded  # False: the read-ahead work runs on this thread (same results, for tests)
        self.buffer: deque = deque()  # (batch number, batch, [host ids per cache])
        self.caches: list[EmbeddingCache] | None = None
        self.worker: ReadAheadBase | None = None
        self.read_count = 0
        self.total: int | None = None  # batches in the source, once it ended
        self.source_error: BaseException | None = None
        self.window_end = 0
        self.window_batches: list[int] = []  # batches admitted per window start (0: per-batch path)
        self.current: tuple[WindowInfo, list] | None = None  # the window in use and its per-cache plans
        self.pending = None  # (start, count, plans, unions) of the next window, planned and in flight
        # window start -> (slot id snapshots, the caches' slot epochs then, their next uses); written by the
        # training thread and by the copier (a window planned in the background snapshots its caches there)
        self.next_uses: dict[int, tuple[list, list, Future]] = {}
        self.snapshot_parts: dict[int, list] = {}  # window start -> per cache (snapshot, epoch) taken so far
        self.lock = threading.Lock()
        self.uniques: dict[int, Future] = {}  # batch -> its forward's unique ids, computed ahead
        self.streams: dict = {}
        self.copier: WindowCopier | None = None  # the host thread moving a CPU window's rows during compute
        self.refused = False
        self.handoff: list[bool] = []  # per cache: whether it takes the forward hand-off
        self.cache_module: list[int] = []  # per cache: the index in `modules` whose ids it is read with
        self.unread = None  # IdsMismatchCheck, once the caches are known
        self.decisions: list[WindowDecision] = []  # one per window, in order (overlap.py)
        self.planned_ahead = None  # (planned_at, locked rows, slots) of the window in `pending`
        self.copies = CopyLog()  # host-to-device copies this loop issued on its hot path

    # ----------------------------------------------------------------- reading
    def _targets(self, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
        """(cache, ids) of every module for `batch`, in module order; notes which module each cache serves."""
        if self.ids_fn is None:
            if self.caches is None:
                refuse_ambiguous_default(self.modules, batch)
            per_module = [default_ids(m, batch) for m in self.modules]
        else:
            ids = list(self.ids_fn(batch))
            if len(ids) != len(self.modules):
                raise ValueError(f"ids(batch) returned {len(ids)} entries for {len(self.modules)} modules: give "
                                 "one per module, in the order of modules")
            # Each module reads its own entry as it would a batch of its own (an id tensor, (ids, offsets), a
            # KeyedJaggedTensor or dict for a collection): ids in its own id space, mapped to its caches' rows.
            per_module = [default_ids(m, module_ids) for m, module_ids in zip(self.modules, ids)]
        if self.caches is None:
            self.cache_module = [i for i, targets in enumerate(per_module) for _ in targets]
        return [t for targets in per_module for t in targets]

    def _start_worker(self, caches: list[EmbeddingCache]) -> None:
        self.caches = caches
        span = self.read_ahead + SPAN_SLACK
        if read_ahead_on_device(caches):
            self.handoff = [False] * len(caches)
            self.worker = DeviceReadAhead([c.cache_rows for c in caches], [c.device for c in caches], self.depth,
                                          self.horizon, span=span, threaded=self.threaded)
            return
        self.handoff = [accepts_ahead(c.device) for c in caches]
        self.worker = ReadAhead([c.cache_rows for c in caches], self.depth, self.horizon, span=span,
                                locate=any(self.handoff), threaded=self.threaded)

    def _read_one(self) -> bool:
        """Read the next batch and hand its ids to the read-ahead thread. An error reading it is kept and
        raised once the loop reaches that batch (every batch read before it is still yielded)."""
        if self.total is not None:
            return False
        start = time.thread_time()
        try:
            batch = next(self.source)
            targets = self._targets(batch)
            caches = [c for c, _ in targets]
            if self.caches is None:
                self._start_worker(caches)
            elif len(caches) != len(self.caches) or any(a is not b for a, b in zip(caches, self.caches)):
                raise ValueError("every batch must give ids for the same caches, in the same order")
        except StopIteration:
            self._end()
            return False
        except Exception as error:  # noqa: BLE001 -- raised in the consumer's loop when it gets there
            self.source_error = error
            self._end()
            return False
        # Private copies: the caller may reuse or change its tensors; the read-ahead thread reads these later.
        ids = [self._private(t) for _, t in targets]
        self.worker.submit_enter(self.read_count, ids)
        self.buffer.append((self.read_count, batch, ids))
        self.read_count += 1
        self._add_seconds("prefetch_read", time.thread_time() - start)
        return True

    def _private(self, t: torch.Tensor) -> torch.Tensor:
        """A private copy of a batch's host ids (the caller may reuse its tensor; the read-ahead reads it later):
        in pinned memory where the device read-ahead takes them to a GPU (its copy is then a non-blocking DMA on
        its side stream, overlap.copy_plan); device ids as they are (the read-ahead copies them in stream order)."""
        if t.device.type != "cpu":
            return t.detach()
        flat = t.detach().reshape(-1)
        if isinstance(self.worker, DeviceReadAhead) and torch.cuda.is_available():
            return torch.empty(flat.shape, dtype=torch.int64, pin_memory=True).copy_(flat)
        return flat.to(torch.int64, copy=True)

    def _end(self) -> None:
        self.total = self.read_count
        if self.worker is not None:
            self.worker.submit_end(self.total)

    def _fill(self) -> None:
        while len(self.buffer) < self.read_ahead + 1 and self._read_one():
            pass

    # ----------------------------------------------------------------- windows
    def _wait(self, future: Future):
        """A result of the read-ahead thread (its exception raised here); the time blocked is prefetch_wait."""
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self._add_seconds("prefetch_wait", time.perf_counter() - start)

    def _raise_read_ahead_error(self) -> None:
        """An error on the read-ahead thread is raised in the training loop at the next batch."""
        failed = self.worker.worker.failed if self.worker is not None else None
        if failed is not None:
            raise failed

    def _start_window(self, start: int) -> None:
        """At a window boundary: switch to the window planned one window ago (its rows were moved meanwhile),
        or admit this window now; then, overlapping, plan and start moving the next one."""
        self.unread.at_window()
        with self.lock:  # next uses of windows already planned
            for stale in [k for k in self.next_uses if k < start]:
                del self.next_uses[stale]
        if self.pending is not None and self.pending[0] == start:
            _, info, plans = self.pending
            self.pending = None
            if any(isinstance(plan, BackgroundPlan) for plan in plans):
                plans = [cache.take_background(plan) for cache, plan in zip(self.caches, plans)]
                if any(plan is None for plan in plans):
                    raise RuntimeError("cachedemb.prefetch: a window planned in the background was not planned")
            for cache, plan in zip(self.caches, plans):
                cache.activate_window(plan)
                cache.trim_resident(self.policy)  # back to cache_rows: the staged rows are the window's now
            self._decide(info, *self.planned_ahead)
            self.planned_ahead = None
        else:
            info = self._wait(self.worker.window_future(start))
            plans = None
            if info.count:
                next_use = self._next_use(start)
                plans = []
                for cache, union, nu in zip(self.caches, info.unions, next_use):
                    plans.append(cache.admit_window(self._upload(union, cache, "window ids"), self.policy, nu,
                                                    now=start))
                    cache.trim_resident(self.policy)
                self._snapshot(info.end)
            else:
                for cache in self.caches:
                    cache.release_window()
            self._decide(info, start, None, [cache.capacity for cache in self.caches], self._why_not)
        self.window_end = info.end
        self.window_batches.append(info.count)
        self.current = (info, plans)
        if not info.count:
            self._why_not = "the batch before it took the per-batch path"
        elif not self._overlapping():
            self._why_not = "overlap off"
        else:
            self._why_not = ""
            self._plan_next(info)

    _why_not = "first window"  # why the next window will not have been planned ahead, if it is not

    def _decide(self, info: WindowInfo, planned_at: int, locked, slots, why: str = "") -> None:
        """Log how the window `info` was admitted (overlap.WindowDecision); `locked`: the rows of the window in
        use kept from being victims while its rows moved (None: it did not overlap)."""
        count = len(self.caches)
        rows = tuple(u.numel() for u in info.unions) if info.count else (0,) * count
        new = tuple(info.new_rows) if info.count and info.new_rows is not None else rows
        overlapped = locked is not None
        if not info.count:
            stream, why = NONE, why or "no window: the batch does not fit the cache"
        elif overlapped:
            stream = SIDE if all(self._moves_aside(cache) for cache in self.caches) else CURRENT
        else:
            stream, why = CURRENT, why or "overlap off"
        locked = tuple(locked) if overlapped else (0,) * count
        union = tuple(a + n for a, n in zip(locked, new)) if overlapped else rows
        self.decisions.append(WindowDecision(info.start, info.count, planned_at, stream, overlapped, rows, new,
                                             union, locked, tuple(slots), "" if overlapped else why))

    def _moves_aside(self, cache: EmbeddingCache) -> bool:
        """Whether a window planned ahead moves this cache's rows off the training thread's stream."""
        return self._side_stream(cache) is not None

    def _upload(self, t: torch.Tensor, cache: EmbeddingCache, site: str) -> torch.Tensor:
        """A read-ahead result on the cache's device: a host one by the hot path's copy rule (overlap.py); one the
        device read-ahead kept there (made on its stream, complete) marked as used by this thread's stream."""
        if t.device == cache.device and t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))
            return t
        return to_device(t, cache.device, self.copies, site)

    def _overlapping(self) -> bool:
        if self.overlap is None:
            self.overlap = bool(self.caches) and all(c.device.type == "cuda" or self.threaded for c in self.caches)
        return self.overlap

    def _side_stream(self, cache: EmbeddingCache):
        """Where a window planned ahead moves its rows: a CUDA side stream; for a CPU cache a host thread (when
        the pipeline is threaded and no host tier in front stages rows meanwhile), else this thread at once."""
        if cache.device.type != "cuda":
            if not self.threaded or cache.host_fence is not None:
                return None
            if self.copier is None:
                self.copier = WindowCopier(self.worker.worker)
            return self.copier
        if cache.device not in self.streams:
            self.streams[cache.device] = torch.cuda.Stream(cache.device)
        return self.streams[cache.device]

    def _plan_next(self, current: WindowInfo) -> None:
        """Plan the window after `current` while `current` is in use, if both fit in every cache together, and
        start its row transfer on a side stream; the current window's rows stay protected."""
        start = current.end
        if self.total is not None and start >= self.total:
            return
        info = self._wait(self.worker.window_future(start))
        if not info.count:
            return
        locked = [a.numel() for a in current.unions]
        new = info.new_rows if info.new_rows is not None else [b.numel() for b in info.unions]
        if not all(fits_beside(a, n, cache.capacity) for a, n, cache in zip(locked, new, self.caches)):
            self._why_not = "the union with the window in use passes the cache's slots"
            return
        self.planned_ahead = (current.start, locked, [cache.capacity for cache in self.caches])
        if self._in_background():
            self.pending = (start, info, self._plan_in_background(start, info))
            return
        next_use = self._next_use(start)
        plans = []
        for cache, union, nu in zip(self.caches, info.unions, next_use):
            plan = cache.plan_window(self._upload(union, cache, "window ids"), self.policy, nu, now=start)
            cache.transfer_window(plan, self._side_stream(cache))
            plans.append(plan)
        self.pending = (start, info, plans)
        self._snapshot(info.end)

    def _in_background(self) -> bool:
        """Whether the next window is planned on the copier too, not only moved there: every cache a CPU cache
        with counts on the host whose rows the copier moves."""
        return bool(self.caches) and all(counts_on_host(cache.device) and
                                         isinstance(self._side_stream(cache), WindowCopier) for cache in self.caches)

    def _plan_in_background(self, start: int, info: WindowInfo) -> list[BackgroundPlan]:
        """Per cache, the window at `start` planned, snapshotted for the window after it and moved on the copier
        (cache.plan_in_background), started by the next forward: the training thread neither plans it nor waits
        for its next uses. The decisions are the ones planning it here would make: the plan reads no metadata of
        the protected window in use, which is all the batches meanwhile touch, and takes the batch counter as
        it is now."""
        copier = self._side_stream(self.caches[0])
        plans = []
        for c, (cache, union) in enumerate(zip(self.caches, info.unions)):
            def run(c=c, cache=cache, union=union, counter=cache.batch_counter):
                try:
                    uses = self._next_use(start, here=False)  # waits for the read-ahead outside the pause
                except CancelledError:  # the loop is closing: the read-ahead stopped, nothing was planned
                    return None
                with copier.pausing():
                    plan = cache.plan_window(self._upload(union, cache, "window ids"), self.policy, uses[c],
                                             now=start, counter=counter)
                    self._snapshot_part(c, cache, info.end)
                    cache.transfer_window(plan)  # the rows, now, on this thread
                return plan
            plans.append(cache.plan_in_background(run, copier))
        return plans

    def _snapshot(self, start: int) -> None:
        """Right after a window's planning: the slots stay as they are until the window starting at `start` is
        planned (its predecessor's batches are all hits), so its next uses are computed meanwhile."""
        if self.total is not None and start >= self.total:
            return
        snapshots = [cache.snapshot_slot_ids() for cache in self.caches]
        with self.lock:
            self._ask_next_uses(start, snapshots, [cache.slot_epoch for cache in self.caches])

    def _snapshot_part(self, c: int, cache: EmbeddingCache, start: int) -> None:
        """Cache c's part of `_snapshot` (a window planned in the background, cache by cache); the next uses are
        asked for once every cache's part is in."""
        if self.total is not None and start >= self.total:
            return
        part = (cache.snapshot_slot_ids(), cache.slot_epoch)
        with self.lock:
            parts = self.snapshot_parts.setdefault(start, [None] * len(self.caches))
            parts[c] = part
            if any(p is None for p in parts):
                return
            del self.snapshot_parts[start]
            self._ask_next_uses(start, [p[0] for p in parts], [p[1] for p in parts])

    def _ask_next_uses(self, start: int, snapshots: list, epochs: list) -> None:
        """Queue the next uses of the window at `start` for these slot snapshots (under `self.lock`)."""
        self.next_uses[start] = (snapshots, epochs, self.worker.submit_next_use(start, snapshots))

    def _next_use(self, start: int, here: bool = True) -> list[SlotNextUse]:
        """The next uses for the window at `start`; `here`: on the training thread (the wait is prefetch_wait)."""
        with self.lock:
            entry = self.next_uses.get(start)
        if entry is None:  # no snapshot since the last planning (first window, or after per-batch batches)
            self._snapshot(start)
            with self.lock:
                entry = self.next_uses[start]
        snapshots, epochs, future = entry
        uses = self._wait(future) if here else future.result()
        uses = [self._upload(u, cache, "next uses") for u, cache in zip(uses, self.caches)]
        ids = [self._upload(ids, cache, "snapshot ids") for (ids, _), cache in zip(snapshots, self.caches)]
        return [SlotNextUse(i, u, start, epoch) for i, u, epoch in zip(ids, uses, epochs)]

    # ----------------------------------------------------------------- hand-off to the forward
    def _request_unique(self, offset: int) -> None:
        """Ask for the forward unique of the batch `offset` places ahead in the buffer."""
        if not any(self.handoff) or offset >= len(self.buffer):
            return
        number, _, ids = self.buffer[offset]
        if number not in self.uniques:
            self.uniques[number] = self.worker.submit_unique(number,
                [t if keep else None for t, keep in zip(ids, self.handoff)])

    def _hand_off(self, number: int) -> None:
        """Give each cache this batch's unique ids (and, inside a window, their slots) if the read-ahead thread
        has them ready; never waits for them."""
        future = self.uniques.pop(number, None)
        if future is None or not future.done():
            return
        results = future.result()
        info, plans = self.current
        for c, (cache, result) in enumerate(zip(self.caches, results)):
            if result is None:
                continue
            ids, unique = result
            loc_u = None
            if plans is not None and info.start <= number < info.end:
                loc_u = plans[c].loc_u.index_select(0, info.positions[number - info.start][c])
            cache.ahead = AheadBatch(ids, unique, loc_u)

    def _add_seconds(self, stage: str, seconds: float) -> None:
        for cache in self.caches or []:
            cache.seconds[stage] += seconds / len(self.caches)

    def _collect_seconds(self) -> None:
        for cache, stages in zip(self.caches, self.worker.take_seconds()):
            for stage, seconds in stages.items():
                cache.seconds[stage] += seconds

    # ----------------------------------------------------------------- the loop
    @contextmanager
    def paused(self):
        """Inside, no thread of this loop makes a CUDA call: the read-ahead thread ends the task it runs and
        starts none until the block ends. Wrap a CUDA graph capture in the loop with it: a capture in the default
        ("global") mode fails when another thread makes an unsafe CUDA call meanwhile (the read-ahead's event
        waits, pinned allocations), and the loop cannot see the capture start. Asking the loop for its next batch
        inside is refused (that waits for the read-ahead)."""
        worker = self.worker.worker if self.worker is not None else None
        if self._held:
            raise RuntimeError("cachedemb.prefetch: paused() is already open on this loop")
        if worker is not None:
            worker.hold()
        self._held = True
        try:
            yield self
        finally:
            self._held = False
            if worker is not None:
                worker.release()

    _held = False

    def _claim(self) -> None:
        """Own the caches for this loop: two pipelines over one cache would each protect and admit their own
        windows and evict the other's rows mid-window. Refused before either changes anything."""
        for cache in self.caches or []:
            owner = getattr(cache, "prefetch_owner", None)
            if owner is not None and owner is not self:
                self.refused = True
                raise RuntimeError(
                    "cachedemb.prefetch: this module's cache is already used by another prefetch loop that has "
                    "not ended. Finish that loop, or close it (a loop left by `break` or an exception ends when "
                    "its iterator is released; call `.close()` on an iterator you keep) before starting another.")
        for cache in self.caches or []:
            cache.prefetch_owner = self
        for cache in self.caches or []:
            cache.reserve_staging(staging_rows_for(self.staging, cache.cache_rows))

    def __iter__(self) -> Iterator:
        self.refused = False
        try:
            self._fill()
            self._claim()
            if self.caches is not None:
                self.unread = IdsMismatchCheck(self.modules, self.caches, self.cache_module, describe_module,
                                               ids_given=self.ids_fn is not None)
            for offset in range(UNIQUE_LEAD):
                self._request_unique(offset)
            while self.buffer:
                number, batch, _ = self.buffer[0]
                self._raise_read_ahead_error()
                if number >= self.window_end:
                    self._start_window(number)
                self._hand_off(number)
                self._request_unique(UNIQUE_LEAD)
                # This batch's forward (one per cache) is all hits; any other forward meanwhile (an eval batch)
                # waits for an in-flight window transfer before it serves rows from the host.
                for cache in self.caches:
                    cache.window_forwards_left = 1
                self._collect_seconds()
                self._notify("on_prefetch_yield")
                yield batch
                if self._held:
                    raise RuntimeError("cachedemb.prefetch: the next batch was asked for inside paused(); end "
                                       "the block first (the loop waits for its read-ahead thread)")
                # The consumer asked for the next batch: this one's forward and backward are done.
                self.unread.after_batch()
                self.buffer.popleft()
                self.uniques.pop(number, None)
                self._read_one()
            if self.source_error is not None:
                raise self.source_error
        finally:
            if sys.is_finalizing():
                # A loop left open until the interpreter exits, collected during its teardown: the worker threads
                # were stopped at exit (read_ahead's atexit hook), and allocating tensors here, in the middle of
                # the garbage collector's last pass, aborts the process. Nothing of the windows outlives it.
                return
            if self.worker is not None:
                self.worker.close()
            failure = None  # a window planned in the background that failed: raised once everything is released
            for cache in self.caches or []:
                if getattr(cache, "prefetch_owner", None) in (self, None):
                    cache.drop_background()  # one no forward started changed nothing: it is not made now
                    try:
                        cache.settle()  # a window's rows still being moved (or planned) by the copier
                    except BaseException as error:  # noqa: BLE001 -- the release below must still run
                        failure = failure or error
            if self.copier is not None:
                self.copier.close()
                self.copier = None
            for cache in self.caches or []:
                if getattr(cache, "prefetch_owner", None) not in (self, None):
                    continue  # another loop's cache (this one was refused): leave its windows alone
                cache.window_forwards_left = 0
                cache.ahead = None
                cache.release_window()  # also unprotects a window planned ahead (overlap), never activated
                if failure is None:
                    cache.trim_resident(self.policy)  # the loop leaves at most cache_rows resident
                cache.prefetch_owner = None
            self.pending = None
            read_ahead_failed = self.worker.worker.failed if self.worker is not None else None
            if not self.refused and self.unread is not None and failure is None and sys.exc_info()[0] in (None, GeneratorExit):
                self.unread.at_end()
            if not self.refused:
                self._notify("on_prefetch_end")  # also when a background plan failed: modules drop what they queued
            if failure is not None and failure is not read_ahead_failed and not isinstance(failure, CancelledError):
                raise failure  # (a read-ahead error is the loop's own, raised where it was met)

    def _notify(self, hook: str) -> None:
        """Modules that act on the batches themselves (a sharded model, whose input all-to-all ran when a batch
        was read ahead) hear when a batch is yielded and when the loop ends."""
        for module in self.modules:
            fn = getattr(module, hook, None)
            if fn is not None:
                fn()


def prefetch(batches: Iterable, modules: Sequence, depth: int = 4, horizon: int = 64, ids: IdsFn | None = None,
             policy: str | Policy = "lookahead", overlap: bool | None = None,
             staging_rows: int | float = 0) -> Prefetcher:
    """Wrap any iterable of batches so the modules' caches admit each window of up to `depth` batches in one go,
    evicting with knowledge of the next `horizon` batches' ids. Yields the batches unchanged.

    `modules`: CachedEmbeddingBag / CachedEmbeddingBagCollection instances used by the model. Their ids are
    read from each batch by `module.prefetch_targets(batch)` (a tensor / (input, offsets, ...) tuple for a
    CachedEmbeddingBag; a KeyedJaggedTensor or dict for a collection) or by `ids(batch) -> [one tensor per
    module]`; they must be the ids the forward will look up. Training through prefetch gives the same table as
    training without it. Batches are read `horizon + 2 * depth` ahead of the one yielded.

    A window holds as many batches (<= depth) as fit: one batch may fill a cache, several at most half of it;
    where not even one batch fits, that batch takes the modules' per-batch path. `overlap` (default: on) plans each
    next window while the current one is in use, when the union of the two fits in the cache's slots, and moves
    its rows on a side stream during the current window's compute (for a CPU cache a host thread plans and moves
    it); the current window's rows are never victims meanwhile. `staging_rows` (an int: rows per cache; a float:
    a share of each cache's rows) gives each cache that many slots beyond its rows, allocated once and kept
    (counted in `device_bytes`), where the next window's new rows land: size it to a batch's misses and every
    window fits beside the one before it, while at each window's start the cache trims itself back to its rows
    (what a cache without staging evicts for that window): overlap then moves no more rows than admitting in
    order (docs/prefetch.md). `Prefetcher.decisions` logs how each window was admitted; `paused()` keeps the
    loop's threads quiet around a CUDA graph capture.
    """
    return Prefetcher(batches, modules, depth=depth, horizon=horizon, ids=ids, policy=policy, overlap=overlap,
                      staging_rows=staging_rows)
