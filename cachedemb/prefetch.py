"""The look-ahead pipeline: read ids ahead, admit each window's rows in one batched transfer.

Two look-aheads with different costs are kept apart:

- the id horizon H: the ids of the next H batches are read ahead (a few MB), so eviction knows each resident
  row's next use (`NextUseTracker`);
- the admission depth K: at the start of every window of K batches, the union of the window's rows is admitted
  in one batched transfer and protected until the window is over, so every forward in the window is all hits.

Stages, in the order they run for each window (all on the caller's thread; on CUDA the copies are issued on the
current stream, ordered after the previous batch's backward and before the window's first forward):

1. read ahead: pull batches from the source until H are buffered; extract each cache's ids on the host and
   record their next-use links;
2. retire: the batch the consumer finished (it asked for the next one) is marked used; next uses advance;
3. admit: when a window starts, the union of its K batches (shrunk to fewer batches if the union exceeds the
   cache) is admitted with the look-ahead policy; the previous window's protection is dropped, the new one set;
4. yield the batch.

Because admission happens when the consumer asks for the next batch, batch i's backward has finished before
any row for batches i+1.. is evicted or filled, and a batch's slot locations never change under it (a batch
whose backward runs after a later admission is refused by the module's generation check, never silently
corrupted). A window too large even for one batch is not admitted: that batch goes through the module's own
per-batch path (spill slots), so the result is the same either way.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, Sequence

import torch

from cachedemb.cache import EmbeddingCache
from cachedemb.policy import Policy, resolve

IdsFn = Callable[[object], Sequence[torch.Tensor]]


class NextUseTracker:
    """Each id's next known use (absolute batch number, -1 = none inside the horizon), kept incrementally:
    O(unique ids) per batch, on the host."""

    def __init__(self, num_rows: int):
        self.next_use = torch.full((num_rows,), -1, dtype=torch.int64)
        self.latest = torch.full((num_rows,), -1, dtype=torch.int64)
        self.links: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.retired_upto = 0  # batches < this have been used

    def enter(self, batch: int, uniq: torch.Tensor) -> None:
        """Batch `batch` (distinct ids `uniq`) joins the horizon."""
        prev = self.latest[uniq]
        pending = prev >= self.retired_upto
        self.next_use[uniq[~pending]] = batch
        if bool(pending.any()):
            waiting, prev_batch = uniq[pending], prev[pending]
            order = torch.argsort(prev_batch)
            batches, counts = torch.unique_consecutive(prev_batch[order], return_counts=True)
            for p, ids in zip(batches.tolist(), torch.split(waiting[order], counts.tolist())):
                self.links.setdefault(p, []).append((ids, batch))
        self.latest[uniq] = batch

    def retire(self, batch: int, uniq: torch.Tensor) -> None:
        """Batch `batch` was used: its ids' next use becomes their next occurrence in the horizon."""
        self.next_use[uniq] = -1
        for ids, succ in self.links.pop(batch, []):
            self.next_use[ids] = succ
        self.retired_upto = batch + 1


def default_ids(module, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
    """(cache, ids in that cache's row space) for a module; modules may define `prefetch_targets(batch)`."""
    if hasattr(module, "prefetch_targets"):
        return list(module.prefetch_targets(batch))
    raise TypeError(f"cannot read ids for {type(module).__name__} from a {type(batch).__name__} batch: pass "
                    "ids=lambda batch: [ids_for_module_0, ...] to prefetch()")


class Prefetcher:
    """Iterator over `batches` that keeps the given modules' caches one window ahead (see module docstring)."""

    def __init__(self, batches: Iterable, modules: Sequence, depth: int = 4, horizon: int = 64,
                 ids: IdsFn | None = None, policy: str | Policy = "lookahead"):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (batches admitted together), got {depth!r}")
        if not isinstance(horizon, int) or horizon < depth:
            raise ValueError(f"horizon must be an int >= depth={depth} (batches whose ids are read ahead), "
                             f"got {horizon!r}")
        if not modules:
            raise ValueError("modules must name at least one CachedEmbeddingBag(-Collection) to prefetch for")
        self.source = iter(batches)
        self.modules = list(modules)
        self.depth, self.horizon = depth, horizon
        self.ids_fn = ids
        self.policy = resolve(policy)
        self.buffer: deque = deque()  # (batch number, batch, [uniq ids per cache])
        self.caches: list[EmbeddingCache] | None = None
        self.trackers: list[NextUseTracker] = []
        self.next_number = 0
        self.window_end = 0
        self.windows = 0
        self.window_batches: list[int] = []

    def _targets(self, batch) -> list[tuple[EmbeddingCache, torch.Tensor]]:
        if self.ids_fn is None:
            return [t for m in self.modules for t in default_ids(m, batch)]
        ids = list(self.ids_fn(batch))
        if len(ids) != len(self.modules):
            raise ValueError(f"ids(batch) returned {len(ids)} tensors for {len(self.modules)} modules")
        targets = []
        for module, module_ids in zip(self.modules, ids):
            cache = getattr(module, "cache", None)
            if not isinstance(cache, EmbeddingCache):
                raise ValueError(f"ids= gives one tensor per module, but {type(module).__name__} is not a single "
                                 "CachedEmbeddingBag; let it read its own ids (omit ids=)")
            targets.append((cache, module_ids))
        return targets

    def _read_one(self) -> bool:
        try:
            batch = next(self.source)
        except StopIteration:
            return False
        targets = self._targets(batch)
        if self.caches is None:
            self.caches = [c for c, _ in targets]
            self.trackers = [NextUseTracker(c.num_rows) for c in self.caches]
        uniq = [torch.unique(ids.detach().reshape(-1).cpu().to(torch.int64)) for _, ids in targets]
        for tracker, u in zip(self.trackers, uniq):
            tracker.enter(self.next_number, u)
        self.buffer.append((self.next_number, batch, uniq))
        self.next_number += 1
        return True

    def _admit_window(self, start: int) -> None:
        """Admit the union of the next `depth` buffered batches, halving the window until it fits."""
        count = min(self.depth, len(self.buffer))
        while count >= 1:
            unions = [torch.unique(torch.cat([self.buffer[i][2][c] for i in range(count)]))
                      for c in range(len(self.caches))]
            if all(u.numel() <= cache.capacity for u, cache in zip(unions, self.caches)):
                break
            count //= 2
        if count == 0:
            for cache in self.caches:
                cache.release_window()
            self.window_end = start + 1
            self.window_batches.append(0)
            return
        for cache, tracker, union in zip(self.caches, self.trackers, unions):
            cache.admit_window(union, self.policy, tracker.next_use, now=start)
        self.window_end = start + count
        self.windows += 1
        self.window_batches.append(count)

    def __iter__(self) -> Iterator:
        try:
            while len(self.buffer) < self.horizon and self._read_one():
                pass
            while self.buffer:
                number, batch, uniq = self.buffer[0]
                if number >= self.window_end:
                    self._admit_window(number)
                yield batch
                # The consumer asked for the next batch: this one's forward and backward are done.
                self.buffer.popleft()
                for tracker, u in zip(self.trackers, uniq):
                    tracker.retire(number, u)
                self._read_one()
        finally:
            for cache in self.caches or []:
                cache.release_window()


def prefetch(batches: Iterable, modules: Sequence, depth: int = 4, horizon: int = 64, ids: IdsFn | None = None,
             policy: str | Policy = "lookahead") -> Prefetcher:
    """Wrap any iterable of batches so the modules' caches admit each window of `depth` batches in one go,
    evicting with knowledge of the next `horizon` batches' ids. Yields the batches unchanged.

    `modules`: CachedEmbeddingBag / CachedEmbeddingBagCollection instances used by the model. Their ids are
    read from each batch by `module.prefetch_targets(batch)` (a tensor / (input, offsets, ...) tuple for a
    CachedEmbeddingBag; a KeyedJaggedTensor or dict for a collection) or by `ids(batch) -> [one tensor per
    module]`. Training through prefetch gives the same table as training without it.
    """
    return Prefetcher(batches, modules, depth=depth, horizon=horizon, ids=ids, policy=policy)
