"""The read-ahead thread: every batch's id work that no forward waits for, off the training loop's thread.

The caller's thread reads each batch from the source and extracts its ids per cache (module code, in batch order:
collectives, RNG use and module state stay where they were), then hands the ids here. One worker thread owns
everything below, so nothing here is shared with the training thread but the futures. Its tasks run in
submission order, except the forward uniques, which go first (a forward is waiting for them soonest):

- `enter`: each cache's distinct ids of the batch (a stable sort), `NextUseTracker.enter`, then every window that
  can be planned (`windows.plan_window`: the unions, built once); where the forward takes a hand-off, the sort's
  permutation is kept (int32, half the batch's ids) so the batch is sorted once, not twice;
- `unique`: the full `unique_ids` of a batch about to be yielded (inverse, counts, lookup groups) from that
  sort, which its forward takes instead of sorting the ids again (a CPU cache with counts on the host: see
  cache/ahead.py);
- `next_use`: the next use of each id of a snapshot of a cache's slot ids, for the policy of a window planned
  later (the snapshot is taken right after the previous window's admission, so this runs meanwhile).

Ids that live on a CUDA device are copied to pinned host memory without blocking; the worker waits for the copy's
event, never the training thread. Torch ops release the GIL, so on a multi-core machine the worker runs beside
the step. An exception in a task is kept in its future and raised in the caller's thread when it asks for the
result; `close` cancels what was not started and joins the thread. `threaded=False` runs every task at once
on the caller's thread (the same results: the tests compare the two).
"""
from __future__ import annotations

import abc
import atexit
import threading
import time
import weakref
from collections import defaultdict, deque
from concurrent.futures import Future

import torch

from cachedemb.kernels.host_sort import stable_sort
from cachedemb.kernels.unique_ids import unique_ids_torch
from cachedemb.prefetch.next_use import NextUseTracker
from cachedemb.prefetch.windows import WindowInfo, plan_window


def to_host(ids: torch.Tensor):
    """(flat int64 host ids, CUDA event to wait for or None): a device tensor is copied without blocking."""
    ids = ids.detach().reshape(-1)
    if ids.device.type == "cuda":
        host = ids.to("cpu", dtype=torch.int64, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(ids.device))
        return host, event
    return ids.to(torch.int64), None


_LIVE_WORKERS: "weakref.WeakSet[Worker]" = weakref.WeakSet()


@atexit.register
def _close_live_workers() -> None:
    """A process that exits with a pipeline still open (a loop left early, an iterator kept) stops its thread
    first: a daemon thread still inside a torch op while the interpreter tears down aborts the process
    ('terminate called without an active exception', exit status 134)."""
    for worker in list(_LIVE_WORKERS):
        worker.close()


class Worker:
    """One thread running submitted calls: urgent ones first, the rest in submission order."""

    def __init__(self, threaded: bool = True, name: str = "cachedemb-read-ahead"):
        self.threaded = threaded
        self.urgent: deque = deque()
        self.ordered: deque = deque()
        self.ready = threading.Condition()
        self.stopping = False
        self.failed: BaseException | None = None
        # set while a window's rows are being moved on another host thread (`pause`): ordered tasks wait to start,
        # so on a small machine the copy (which the next window waits for) does not share a core with the
        # read-ahead; urgent ones (a forward's unique ids, needed sooner than the copy) still start
        self.paused = False
        # set while the training thread holds the worker (`hold`: a CUDA graph capture): no task starts, urgent
        # ones included; `running` says whether a call is under way (`hold` waits for it to end)
        self.held = False
        self.running = False
        self.thread = None
        if threaded:
            self.thread = threading.Thread(target=self._run, name=name, daemon=True)
            self.thread.start()
            _LIVE_WORKERS.add(self)

    def submit(self, fn, *args, urgent: bool = False) -> Future:
        future = Future()
        if not self.threaded:
            self._call(future, fn, args)
            return future
        with self.ready:
            if self.stopping:
                future.cancel()
                return future
            (self.urgent if urgent else self.ordered).append((future, fn, args))
            self.ready.notify_all()
        return future

    def _call(self, future: Future, fn, args) -> None:
        """Run one call; after a call failed, every later one fails with that error (the state it left is
        not to be built on), which `failed` also holds for the caller to raise."""
        if not future.set_running_or_notify_cancel():
            return
        if self.failed is not None:
            future.set_exception(self.failed)
            return
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 -- handed to the caller's thread through the future
            self.failed = error
            future.set_exception(error)

    def pause(self) -> None:
        """Start no ordered task until `resume` (urgent ones still start)."""
        with self.ready:
            self.paused = True

    def resume(self) -> None:
        with self.ready:
            self.paused = False
            self.ready.notify_all()

    def hold(self) -> None:
        """Start no task until `release`, and return once the running one (if any) has ended: the thread makes
        no call meanwhile."""
        with self.ready:
            self.held = True
            while self.running:
                self.ready.wait()

    def release(self) -> None:
        with self.ready:
            self.held = False
            self.ready.notify_all()

    def _run(self) -> None:
        while True:
            with self.ready:
                while not ((not self.held and (self.urgent or (self.ordered and not self.paused))) or self.stopping):
                    self.ready.wait()
                if self.stopping:
                    return
                future, fn, args = (self.urgent or self.ordered).popleft()
                self.running = True
            try:
                self._call(future, fn, args)
            finally:
                with self.ready:
                    self.running = False
                    self.ready.notify_all()

    def close(self) -> None:
        """Cancel what has not started; wait for the running call."""
        if self.thread is None:
            return
        with self.ready:
            self.stopping = True
            for future, _, _ in list(self.urgent) + list(self.ordered):
                future.cancel()
            self.urgent.clear()
            self.ordered.clear()
            self.ready.notify_all()
        self.thread.join()
        _LIVE_WORKERS.discard(self)


class ReadAheadBase(abc.ABC):
    """The plumbing the host and the device read-ahead share: the worker thread, each window planned as soon as
    its batches are in (a future the training thread waits on), next uses per window snapshot, thread seconds per
    stage. A subclass enters a batch's ids (`_enter`), plans one window (`_plan`) and answers one snapshot's next
    uses (`_slot_uses`)."""

    def __init__(self, capacities: list[int], depth: int, horizon: int, threaded: bool, name: str):
        self.depth, self.horizon = depth, horizon
        self.capacities = list(capacities)
        self.entered = 0
        self.total: int | None = None  # batches in the source, once it ended
        self.next_start = 0  # the next window to plan
        self.prev_start: int | None = None  # the window planned last (its batches end at next_start)
        self.lock = threading.Lock()
        self.windows: dict[int, Future] = {}
        self.seconds: list[dict[str, float]] = [defaultdict(float) for _ in capacities]
        self.worker = Worker(threaded, name=name)

    # ----------------------------------------------------------------- caller's thread
    def submit_end(self, total: int) -> Future:
        return self.worker.submit(self._end, total)

    def window_future(self, start: int) -> Future:
        """The window starting at `start`, once the worker planned it."""
        with self.lock:
            if start not in self.windows:
                self.windows[start] = Future()
            return self.windows[start]

    def submit_next_use(self, now: int, snapshots: list) -> Future:
        """Next uses in [now, now + horizon) of the ids of each snapshot (host ids, CUDA event or None), as
        batches from `now` (-1: none), in tensors of the caller's."""
        return self.worker.submit(self._next_use, now, snapshots)

    def take_seconds(self) -> list[dict[str, float]]:
        with self.lock:
            out, self.seconds = self.seconds, [defaultdict(float) for _ in self.seconds]
        return out

    def close(self) -> None:
        self.worker.close()
        with self.lock:
            for future in self.windows.values():
                future.cancel()

    # ----------------------------------------------------------------- worker thread
    def _time(self, cache: int, stage: str, since: float) -> float:
        now = time.thread_time()
        with self.lock:
            self.seconds[cache][stage] += now - since
        return now

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
            info = self._plan(start, available, self.prev_start)
            for c in range(len(self.capacities)):
                self._time(c, "prefetch_window_plan", began)
            self.prev_start, self.next_start = start, info.end
            future = self.window_future(start)
            if not future.cancelled():
                future.set_result(info)

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
            out.append(self._slot_uses(c, ids, now))
            self._time(c, "prefetch_next_use_query", start)
        return out

    @abc.abstractmethod
    def _enter(self, number: int, staged) -> None:
        """Batch `number`'s staged ids per cache into the trackers; then `_plan_windows`."""

    @abc.abstractmethod
    def _plan(self, start: int, available: int, prev_start: int | None) -> WindowInfo:
        """The window starting at `start`, from the `available` batches entered from there; its `new_rows`
        counted against the window at `prev_start` (None: the first)."""

    @abc.abstractmethod
    def _slot_uses(self, c: int, ids: torch.Tensor, now: int) -> torch.Tensor:
        """Cache c's snapshot ids' next uses from `now` (-1: none), a host tensor of the caller's."""


class ReadAhead(ReadAheadBase):
    """Worker-thread state for caches of `capacities` rows, windows of up to `depth` batches, next uses over
    `horizon` batches; `span` batches of uses are kept (the read-ahead distance plus slack). `locate`: find each
    batch's ids in its window's union (for the forward hand-off)."""

    def __init__(self, capacities: list[int], depth: int, horizon: int, span: int, locate: bool,
                 threaded: bool = True):
        super().__init__(capacities, depth, horizon, threaded, name="cachedemb-read-ahead")
        self.locate = locate
        self.trackers = [NextUseTracker(None, span) for _ in capacities]
        self.sorts: dict[int, list] = {}  # batch -> per cache: the permutation of its stable sort (int32) or None

    # ----------------------------------------------------------------- caller's thread
    def submit_enter(self, number: int, ids: list[torch.Tensor]) -> Future:
        """Batch `number`'s ids per cache (host tensors the caller will not change, or device tensors)."""
        staged = [to_host(t) for t in ids]
        return self.worker.submit(self._enter, number, staged)

    def submit_unique(self, number: int, ids: list[torch.Tensor | None]) -> Future:
        """Per cache: (ids, unique_ids(ids, None, return_groups=True)) of batch `number`'s host ids (the caller
        will not change them), or None where ids is None: what that batch's forward computes (urgent)."""
        return self.worker.submit(self._unique, number, ids, urgent=True)

    def close(self) -> None:
        super().close()
        self.sorts.clear()

    # ----------------------------------------------------------------- worker thread
    def _enter(self, number: int, staged) -> None:
        sorts = []
        for c, (host, event) in enumerate(staged):
            start = time.thread_time()
            if event is not None:
                event.synchronize()
            s_ids, s_perm = stable_sort(host)
            uniq = torch.unique_consecutive(s_ids)
            sorts.append(s_perm.to(torch.int32) if self.locate and event is None and host.numel() < 2**31 else None)
            start = self._time(c, "prefetch_unique", start)
            self.trackers[c].enter(number, uniq)
            self._time(c, "prefetch_next_use", start)
        if self.locate:
            self.sorts[number] = sorts
        self.entered = number + 1
        self._plan_windows()

    def _plan(self, start: int, available: int, prev_start: int | None) -> WindowInfo:
        return plan_window(start, available, self.trackers, self.capacities, self.depth, self.locate, prev_start)

    def _slot_uses(self, c: int, ids: torch.Tensor, now: int) -> torch.Tensor:
        return self.trackers[c].slot_uses(ids, now, self.horizon, relative=True)

    def _unique(self, number: int, ids: list[torch.Tensor | None]) -> list:
        sorts = self.sorts.pop(number, None)  # None if this ran before the batch's `enter` (urgent tasks go first)
        for stale in [k for k in self.sorts if k < number]:  # an `enter` that ran after its batch's unique
            del self.sorts[stale]
        out = []
        for c, host in enumerate(ids):
            if host is None:
                out.append(None)
                continue
            start = time.thread_time()
            sort = None
            if sorts is not None and sorts[c] is not None:
                s_perm = sorts[c].to(torch.int64)
                sort = (host.index_select(0, s_perm), s_perm)
            out.append((host, unique_ids_torch(host, None, return_groups=True, sort=sort)))
            self._time(c, "prefetch_forward_unique", start)
        return out
