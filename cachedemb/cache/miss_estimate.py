"""How many rows a cache's batches miss, known on the host without a host sync.

Under the CUDA rules the host never waits for a device count, so per-batch work is sized by static bounds: a
batch's lookups. The victim pool needs only about as many victims as a batch misses, often a small fraction of
its lookups. Each batch's miss count is copied to pinned host memory without blocking and read once its event
says it landed (on CPU, standing in for that, `lag` batches later). The estimate (the largest recent count) only
sizes work whose sufficiency is checked on the device: an estimate too small costs a gated fallback that runs
there, never a wrong result. A batch pushed as [hits, misses] also tells its distinct ids (`distinct_peak`, for
the module's too-small-cache warning), in the same copy.
"""
from __future__ import annotations

import collections

import torch

from cachedemb.cache.exact_device import exact_device


class MissEstimate:
    """The largest of the last `window` miss counts that reached the host."""

    def __init__(self, device: torch.device, lag: int = 2, window: int = 64, buffers: int = 16):
        self.device, self.lag = exact_device(device), int(lag)
        cuda = self.device.type == "cuda"
        self._free = [torch.zeros(2, dtype=torch.int64, pin_memory=cuda) for _ in range(buffers)]
        # (host buffer, event or None, push number, values pushed)
        self._pending: collections.deque = collections.deque()
        self._recent: collections.deque = collections.deque(maxlen=window)
        self._pushes = 0
        self.distinct_peak = 0  # the most distinct ids (hits + misses) of a batch pushed with its hits, landed

    def push(self, count: torch.Tensor) -> None:
        """Start copying this batch's count ([1] int64 misses, or [2] hits and misses, on the cache device) to
        the host; never waits."""
        if self._capturing():
            return  # a captured step replays without the host: nothing to read back
        cuda = self.device.type == "cuda"
        self._fold()
        if not self._free:
            return  # every buffer still in flight: skip this sample
        host = self._free.pop()
        n = count.numel()
        host[:n].copy_(count.reshape(n), non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._pending.append((host, event, self._pushes, n))
        self._pushes += 1

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _fold(self) -> None:
        """Take in the counts that have landed, oldest first (not while a CUDA graph is captured: an event
        query is not allowed then, and the captured sizes come from the counts already in)."""
        if self._capturing():
            return
        while self._pending:
            host, event, number, n = self._pending[0]
            landed = event.query() if event is not None else self._pushes - number > self.lag
            if not landed:
                return
            self._pending.popleft()
            values = host.tolist()[:n]  # a host buffer: no device op
            self._recent.append(values[-1])
            if n == 2:
                self.distinct_peak = max(self.distinct_peak, values[0] + values[1])
            self._free.append(host)

    def value(self) -> int | None:
        """The largest recent count on the host, or None before any has landed."""
        self._fold()
        return max(self._recent) if self._recent else None
