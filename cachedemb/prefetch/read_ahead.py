"""The read-ahead thread: every batch's id work that no forward waits for, off the training loop's thread.

The caller's thread reads each batch from the source and extracts its ids per cache (module code, in batch order:
collectives, RNG use and module state stay where they were), then hands the ids here. One worker thread, tasks in
submission order, owns everything below, so nothing here is shared with the training thread but the futures:

- `enter`: each cache's distinct ids of the batch (a sort), `NextUseTracker.enter`, then every window that can be
  planned (`windows.plan_window`: the unions, built once);
- `unique_for`: the full `unique_ids` of a batch about to be yielded (inverse, counts, lookup groups), which its
  forward takes instead of sorting the ids again (a CPU cache with counts on the host: see cache/ahead.py);
- `next_use`: the next use of each id of a snapshot of a cache's slot ids, for the policy of a window planned
  later (the snapshot is taken right after the previous window's admission, so this runs meanwhile).

Ids that live on a CUDA device are copied to pinned host memory without blocking; the worker waits for the copy's
event, never the training thread. Torch ops release the GIL, so on a multi-core machine the worker runs beside
the step. An exception in a task is kept in its future and raised in the caller's thread when it asks for the
result; `close` cancels what was not started and joins the thread.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cachedemb.kernels.unique_ids import unique_ids_torch
from cachedemb.prefetch.next_use import NextUseTracker
from cachedemb.prefetch.windows import plan_window


def to_host(ids: torch.Tensor):
    """(flat int64 host ids, CUDA event to wait for or None): a device tensor is copied without blocking."""
    ids = ids.detach().reshape(-1)
    if ids.device.type == "cuda":
        host = ids.to("cpu", dtype=torch.int64, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(ids.device))
        return host, event
    return ids.to(torch.int64), None


class ReadAhead:
    """Worker-thread state for caches of `capacities` rows, windows of up to `depth` batches, next uses over
    `horizon` batches; `span` batches of uses are kept (the read-ahead distance plus slack). `keep_ids[c]`: keep
    cache c's ids until its forward's unique is asked for (the caches that take a hand-off)."""

    def __init__(self, capacities: list[int], depth: int, horizon: int, span: int, keep_ids: list[bool]):
        self.depth, self.horizon, self.keep_ids = depth, horizon, list(keep_ids)
        self.locate = any(keep_ids)
        self.trackers = [NextUseTracker(None, span) for _ in capacities]
        self.capacities = list(capacities)
        self.uniq: dict[int, list[torch.Tensor]] = {}  # batch -> distinct ids per cache, until its window is planned
        self.ids: dict[int, list[torch.Tensor]] = {}  # batch -> host ids per cache, until its forward's unique
        self.entered = 0
        self.total: int | None = None  # batches in the source, once it ended
        self.next_start = 0  # the next window to plan
        self.lock = threading.Lock()
        self.windows: dict[int, Future] = {}
        self.seconds: list[dict[str, float]] = [defaultdict(float) for _ in capacities]
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="cachedemb-read-ahead")

    # ----------------------------------------------------------------- caller's thread
    def submit_enter(self, number: int, ids: list[torch.Tensor]) -> Future:
        """Batch `number`'s ids per cache (host tensors the caller will not change, or device tensors)."""
        staged = [to_host(t) for t in ids]
        return self.executor.submit(self._enter, number, staged)

    def submit_end(self, total: int) -> Future:
        return self.executor.submit(self._end, total)

    def window_future(self, start: int) -> Future:
        """The window starting at `start`, once the worker planned it."""
        with self.lock:
            if start not in self.windows:
                self.windows[start] = Future()
            return self.windows[start]

    def submit_unique(self, number: int) -> Future:
        return self.executor.submit(self._unique_for, number)

    def submit_next_use(self, now: int, snapshots: list) -> Future:
        """Next uses in [now, now + horizon) of the ids of each snapshot (host ids, CUDA event or None)."""
        return self.executor.submit(self._next_use, now, snapshots)

    def take_seconds(self) -> list[dict[str, float]]:
        with self.lock:
            out, self.seconds = self.seconds, [defaultdict(float) for _ in self.seconds]
        return out

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            for future in self.windows.values():
                future.cancel()

    # ----------------------------------------------------------------- worker thread
    def _time(self, cache: int, stage: str, since: float) -> float:
        now = time.thread_time()
        with self.lock:
            self.seconds[cache][stage] += now - since
        return now

    def _enter(self, number: int, staged) -> None:
        ids = []
        for c, (host, event) in enumerate(staged):
            start = time.thread_time()
            if event is not None:
                event.synchronize()
            uniq = torch.unique(host)
            start = self._time(c, "prefetch_unique", start)
            self.trackers[c].enter(number, uniq)
            self._time(c, "prefetch_next_use", start)
            ids.append(host if self.keep_ids[c] else None)
            self.uniq.setdefault(number, []).append(uniq)
        if any(self.keep_ids):
            self.ids[number] = ids
        self.entered = number + 1
        self._plan_windows()

    def _end(self, total: int) -> None:
        self.total = total
        self._plan_windows()

    def _plan_windows(self) -> None:
        """Plan every window whose batches were all read (or the source ended)."""
        while True:
            start = self.next_start
            available = self.entered - start
            if available <= 0 or (available < self.depth and self.total is None):
                return
            began = time.thread_time()
            info = plan_window(start, [self.uniq[b] for b in range(start, start + min(available, self.depth))],
                               self.capacities, self.depth, self.locate)
            for c in range(len(self.capacities)):
                self._time(c, "prefetch_window_plan", began)
            for b in range(start, info.end):
                self.uniq.pop(b)
            self.next_start = info.end
            future = self.window_future(start)
            if not future.cancelled():
                future.set_result(info)

    def _unique_for(self, number: int) -> list:
        """Per cache: (ids, unique_ids(ids, None, return_groups=True)) of batch `number`, what its forward
        computes, or None for a cache that takes no hand-off. Batches before it are not asked for any more."""
        for old in [b for b in self.ids if b < number]:
            del self.ids[old]
        out = []
        for c, ids in enumerate(self.ids.pop(number, [None] * len(self.keep_ids))):
            if ids is None:
                out.append(None)
                continue
            start = time.thread_time()
            out.append((ids, unique_ids_torch(ids, None, return_groups=True)))
            self._time(c, "prefetch_forward_unique", start)
        return out

    def _next_use(self, now: int, snapshots: list) -> list[torch.Tensor]:
        horizon_end = now + self.horizon if self.total is None else min(now + self.horizon, self.total)
        if self.entered < horizon_end:
            raise AssertionError(f"next uses from batch {now} need batches up to {horizon_end - 1} read, "
                                 f"have {self.entered}")
        out = []
        for c, (ids, event) in enumerate(snapshots):
            start = time.thread_time()
            if event is not None:
                event.synchronize()
            out.append(self.trackers[c].first_use(ids, now, self.horizon))
            self._time(c, "prefetch_next_use_query", start)
        return out
