"""The read-ahead's id work on the caches' GPU: for CUDA caches, the same answers as the host read-ahead at a
small fraction of its cost.

On the host, a batch of 426k ids costs ~25 ms of one core (its sort, the next-use map's update, the window's
next-use query): on a GPU, whose step takes a few ms, the pipeline waited for it and prefetch made the step ~3x
slower (benchmarks/results/gpu/). Here each batch's distinct ids are sorted once on the device and kept for the
horizon (O(horizon x distinct ids) of device memory), and every question is a binary search into those sorted
arrays, a few launches per batch of the horizon:

- a window's union (`plan_window`, shared with the host path): a batch adds its ids no earlier batch of the
  window has (`unused_between`), in the batch's ascending order, as the host tracker orders them;
- next uses (`slot_uses`): each slot id's first batch in [now, now + horizon) whose sorted ids hold it.

The work runs on the read-ahead thread (`read_ahead.Worker`) on a side stream of its own; counts are read there
through events (that thread waits, the training thread never does; nothing torch's sync debug mode flags). What
leaves the thread (unions, next uses) stays on the device, complete when handed over (the thread waited for its
event); the training thread marks its stream's use of each (`record_stream`), so the side stream's allocator
never hands the memory out while the training thread's stream still reads it. `CACHEDEMB_READ_AHEAD=host|device`
chooses the read-ahead (default: device when every cache is on CUDA); the device one also runs on CPU tensors,
where the tests compare it with the host one.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future

import torch

from cachedemb.prefetch.read_ahead import ReadAheadBase
from cachedemb.prefetch.windows import WindowInfo, plan_window


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: from a GPU, copied to pinned memory and waited for through an event, not a stream
    sync. torch's sync debug mode (`torch.cuda.set_sync_debug_mode("error")`, which a user may set to check the
    training loop) is global and flags stream syncs and synchronizing copies on every thread, not an event wait.
    Results handed to the training thread go this way too: no tensor of the side stream's allocator leaves it."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    event.synchronize()
    return host


def _complete(t: torch.Tensor) -> torch.Tensor:
    """`t` as it is, once this thread's stream has written it (an event waited for here, on this thread): a
    result kept on the device for the training thread, which marks its own stream's use of the memory
    (`record_stream`, pipeline.Prefetcher._upload) so the side stream's allocator does not reuse it early."""
    if t.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        event.synchronize()
    return t


def _count(t: torch.Tensor) -> int:
    """A device count read on this thread (through `_on_host`)."""
    return int(_on_host(t))


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Indices of a 1-D mask's set entries (its count read through `_count`, then a static-size nonzero)."""
    return torch.nonzero_static(mask, size=_count(mask.sum())).reshape(-1)


def _sorted_unique(ids: torch.Tensor) -> torch.Tensor:
    """The distinct ids, ascending (torch.unique, without its synchronizing size read on a GPU)."""
    if ids.numel() == 0:
        return ids.clone()
    s = torch.sort(ids).values
    heads = torch.ones_like(s, dtype=torch.bool)
    torch.ne(s[1:], s[:-1], out=heads[1:])
    return s.index_select(0, _nonzero(heads))


def _member(query: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
    """Whether each query id is in `sorted_ids` (ascending, distinct)."""
    if sorted_ids.numel() == 0:
        return torch.zeros_like(query, dtype=torch.bool)
    at = torch.searchsorted(sorted_ids, query).clamp_(max=sorted_ids.numel() - 1)
    return sorted_ids.index_select(0, at) == query


class SortedIdsTracker:
    """Each batch's distinct ids, sorted, for the last `span` batches entered: `NextUseTracker`'s questions of the
    window planner and the policy, answered by binary searches (the same answers)."""

    def __init__(self, span: int):
        self.span = span
        self.entered = 0
        self.ring: dict[int, torch.Tensor] = {}

    def enter(self, batch: int, uniq: torch.Tensor) -> None:
        """Batch `batch` (its distinct ids, ascending) joins the horizon."""
        if batch != self.entered:
            raise ValueError(f"batches enter in order: expected batch {self.entered}, got {batch}")
        self.ring.pop(batch - self.span, None)
        self.ring[batch] = uniq
        self.entered += 1

    def _check(self, lo: int) -> None:
        if lo < self.entered - self.span:
            raise ValueError(f"batch {lo} left the tracker's span ({self.span} batches before batch "
                             f"{self.entered}): query before reading that far ahead, or use a larger span")

    def ring_entry(self, batch: int) -> tuple[torch.Tensor, None]:
        """(distinct ids, no map positions: windows planned here locate nothing)."""
        return self.ring[batch], None

    def unused_between(self, batch: int, lo: int, hi: int, budget: int) -> torch.Tensor | None:
        """Indices (ascending) of `batch`'s distinct ids no batch in [lo, hi) uses, or None when more than
        `budget` (one count read on this thread)."""
        self._check(lo)
        ids = self.ring[batch]
        used = torch.zeros_like(ids, dtype=torch.bool)
        for b in range(lo, hi):
            used |= _member(ids, self.ring[b])
        fresh = _nonzero(~used)
        return None if fresh.numel() > max(budget, 0) else fresh

    def slot_uses(self, ids: torch.Tensor, now: int, horizon: int, relative: bool = False) -> torch.Tensor:
        """Each id's first use among batches [now, now + horizon) entered (absolute, or from `now` when
        `relative`), -1 for none and for negative ids (empty slots)."""
        self._check(now)
        hi = min(now + max(horizon, 0), self.entered)
        first = torch.full_like(ids, -1)
        for b in range(hi - 1, now - 1, -1):  # latest first: the earliest batch holding an id writes last
            first.masked_fill_(_member(ids, self.ring[b]), b - now if relative else b)
        return first.masked_fill_(ids < 0, -1)


class DeviceReadAhead(ReadAheadBase):
    """`ReadAhead`'s interface (enter, end, windows, next uses) for caches on `devices`; no forward hand-off."""

    def __init__(self, capacities: list[int], devices: list[torch.device], depth: int, horizon: int, span: int,
                 threaded: bool = True):
        super().__init__(capacities, depth, horizon, threaded, name="cachedemb-device-read-ahead")
        self.devices = list(devices)
        self.trackers = [SortedIdsTracker(span) for _ in capacities]
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    # ----------------------------------------------------------------- caller's thread
    def submit_enter(self, number: int, ids: list[torch.Tensor]) -> Future:
        """Batch `number`'s ids per cache: host tensors the caller will not change, or device tensors (copied
        here, in the caller's stream order, so the caller may reuse them)."""
        staged = []
        for t in ids:
            t = t.detach().reshape(-1)
            event = None
            if t.device.type == "cuda":
                t = t.to(torch.int64, copy=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(t.device))
            staged.append((t, event))
        return self.worker.submit(self._enter, number, staged)

    def submit_unique(self, number: int, ids) -> Future:
        raise RuntimeError("the device read-ahead hands no unique ids to a forward (CPU caches' hand-off)")

    # ----------------------------------------------------------------- worker thread
    def _stream(self, device: torch.device):
        """This thread's side stream on a CUDA device (none on CPU)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return torch.cuda.stream(self.streams[device])

    @staticmethod
    def _on(device: torch.device, ids: torch.Tensor) -> torch.Tensor:
        """Ids (int64) on `device`; host ids go through pinned memory, so the copy does not synchronize."""
        ids = ids.to(torch.int64)
        if device.type != "cuda" or ids.device == device:
            return ids
        if not ids.is_pinned():
            ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True).copy_(ids)
        return ids.to(device, non_blocking=True)

    def _enter(self, number: int, staged) -> None:
        for c, ((ids, event), device) in enumerate(zip(staged, self.devices)):
            start = time.thread_time()
            with self._stream(device):
                if event is not None:
                    torch.cuda.current_stream(device).wait_event(event)
                uniq = _sorted_unique(self._on(device, ids))
                self.trackers[c].enter(number, uniq)
            self._time(c, "prefetch_unique", start)
        self.entered = number + 1
        self._plan_windows()

    def _plan(self, start: int, available: int, prev_start: int | None) -> WindowInfo:
        with contextlib.ExitStack() as streams:
            for device in dict.fromkeys(self.devices):
                streams.enter_context(self._stream(device))
            info = plan_window(start, available, self.trackers, self.capacities, self.depth, locate=False,
                               prev_start=prev_start)
            if info.unions is not None:
                info.unions = [_complete(u) for u in info.unions]  # kept on the device: no round trip
        return info

    def _slot_uses(self, c: int, ids: torch.Tensor, now: int) -> torch.Tensor:
        device = self.devices[c]
        with self._stream(device):
            uses = self.trackers[c].slot_uses(self._on(device, ids), now, self.horizon, relative=True)
            return _complete(uses)
