"""The look-ahead pipeline: read ids ahead, admit each window's rows in one batched transfer.

Two look-aheads with different costs are kept apart:

- the id horizon H: the ids of the next H batches are read ahead (a few MB), so eviction knows each resident
  row's next use (`NextUseTracker`);
- the admission depth K: the union of each window of K batches is admitted in one batched transfer and
  protected until the window is over, so every forward in the window is all hits.

Stages and streams, per window (all decided on the caller's thread, when the consumer asks for the batch that
starts a window — so the previous batch's backward has been issued):

1. read ahead (host): pull batches until H are buffered; extract each cache's ids; record next-use links.
2. retire (host): the batch the consumer finished is marked used; next uses advance.
3. switch (current stream): if this window was planned one window ago, the current stream waits for its
   transfer event and its rows become the protected set; otherwise it is admitted now, in stream order
   (`admit_window`), shrinking the window until its union fits.
4. plan next (current stream), with `overlap` (default for CUDA caches): if the next window fits in the cache
   together with this one, its victims are chosen among rows neither window needs, and slot metadata and the
   index change now; its row copies (dirty victims out, missing rows in, zero-copy through pinned host memory)
   run on a side stream that first waits for everything issued so far on the current stream (the last
   backward included) and records an event; the tensors it uses are `record_stream`-ed to it.
5. yield the batch; its forward and backward run on the current stream, overlapping the side-stream copies.
   They touch only this window's rows, which the copies never touch.

Hazards this rules out (each is tested): a row an in-flight batch needs being evicted (it is protected); the
backward of batch i racing the admission for later batches (the side stream waits for it; victims exclude
both windows); a batch keeping slot locations a later admission changed (the module's generation check
refuses such a backward rather than corrupting rows); a forward of other ids inside the loop (an eval batch)
reading a host row that the side stream is still writing back (the first forward per cache after a batch is
yielded is taken as that batch's, all hits; any further one waits for the transfer). A window too large even
for one batch is not admitted: that batch goes through the module's own per-batch path (misses beyond the free
slots served from the host), so the result is the same either way.
The ids a batch is read with must be the ids its forward looks up (the default extraction guarantees it).

On a sharded model (`cachedemb.distributed.shard`), reading a batch ahead runs its input all-to-all, as
torchrec's sparse-dist train pipeline does: each rank's horizon and windows see the ids it owns after the
exchange, and the batch's forward (the first after its yield) uses the exchanged input.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, Sequence

import torch

from cachedemb.cache.embedding_cache import EmbeddingCache
from cachedemb.cache.policy import Policy, resolve

IdsFn = Callable[[object], Sequence[torch.Tensor]]


class NextUseTracker:
    """Each id's next known use (absolute batch number, -1 = none inside the horizon), kept incrementally:
    O(unique ids) per batch, on the host."""

    def __init__(self, num_rows: int):
        # Pinned where CUDA exists: window admission reads it from the device without a staged copy. The host
        # may advance it before that read runs; that only changes which rows a policy prefers, never results.
        self.next_use = torch.full((num_rows,), -1, dtype=torch.int64, pin_memory=torch.cuda.is_available())
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
                 ids: IdsFn | None = None, policy: str | Policy = "lookahead", overlap: bool | None = None):
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
        self.window_batches: list[int] = []  # batches admitted per window start (0: per-batch path)
        self.overlap = overlap  # None: decided by the caches' device (on for CUDA)
        self.current_unions: list[torch.Tensor] | None = None
        self.pending = None  # (start, count, plans, unions) of the next window, planned and in flight
        self.streams: dict = {}

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

    def _unions(self, offset: int, count: int) -> list[torch.Tensor]:
        return [torch.unique(torch.cat([self.buffer[i][2][c] for i in range(offset, offset + count)]))
                for c in range(len(self.caches))]

    def _fitting_window(self, offset: int, keep: list[torch.Tensor] | None):
        """The largest count <= depth (halving) of buffered batches from `offset` whose union fits every cache
        together with `keep` (the window still in use); (0, None) if not even one batch fits."""
        count = min(self.depth, len(self.buffer) - offset)
        while count >= 1:
            unions = self._unions(offset, count)
            need = unions if keep is None else [torch.unique(torch.cat([u, k])) for u, k in zip(unions, keep)]
            if all(u.numel() <= cache.capacity for u, cache in zip(need, self.caches)):
                return count, unions
            count //= 2
        return 0, None

    def _start_window(self, start: int) -> None:
        """At a window boundary: switch to the window planned one window ago (its rows were moved meanwhile),
        or admit this window now; then, overlapping, plan and start moving the next one."""
        if self.pending is not None and self.pending[0] == start:
            _, count, plans, unions = self.pending
            self.pending = None
            for cache, plan in zip(self.caches, plans):
                cache.activate_window(plan)
        else:
            count, unions = self._fitting_window(0, None)
            for cache, tracker, union in zip(self.caches, self.trackers, unions or [None] * len(self.caches)):
                if count:
                    cache.admit_window(union, self.policy, tracker.next_use, now=start)
                else:
                    cache.release_window()
        self.window_end = start + max(count, 1)
        self.window_batches.append(count)
        self.current_unions = unions
        if self._overlapping() and count:
            self._plan_next(self.window_end)

    def _overlapping(self) -> bool:
        if self.overlap is None:
            self.overlap = all(c.device.type == "cuda" for c in self.caches)
        return self.overlap

    def _side_stream(self, cache: EmbeddingCache):
        if cache.device.type != "cuda":
            return None
        if cache.device not in self.streams:
            self.streams[cache.device] = torch.cuda.Stream(cache.device)
        return self.streams[cache.device]

    def _plan_next(self, start: int) -> None:
        """Plan the window starting at `start` while the current one is in use (both must fit together) and
        start its row transfer on a side stream; the current window's rows stay protected."""
        offset = start - self.buffer[0][0]
        if offset >= len(self.buffer):
            return
        count, unions = self._fitting_window(offset, self.current_unions)
        if count < min(self.depth, len(self.buffer) - offset):
            # Only a whole window is worth moving early: a shrunken one fragments later windows and, with the
            # current window pinned, leaves the policy little choice (more rows moved overall).
            return
        plans = []
        for cache, tracker, union in zip(self.caches, self.trackers, unions):
            plan = cache.plan_window(union, self.policy, tracker.next_use, now=start)
            cache.transfer_window(plan, self._side_stream(cache))
            plans.append(plan)
        self.pending = (start, count, plans, unions)

    def _fill_horizon(self) -> None:
        while len(self.buffer) < self.horizon:
            if not self._read_one():
                return

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

    def __iter__(self) -> Iterator:
        self.refused = False
        try:
            self._fill_horizon()
            self._claim()
            while self.buffer:
                number, batch, uniq = self.buffer[0]
                if number >= self.window_end:
                    self._start_window(number)
                # This batch's forward (one per cache) is all hits; any other forward meanwhile (an eval batch)
                # waits for an in-flight window transfer before it serves rows from the host.
                for cache in self.caches:
                    cache.window_forwards_left = 1
                self._notify("on_prefetch_yield")
                yield batch
                # The consumer asked for the next batch: this one's forward and backward are done.
                self.buffer.popleft()
                for tracker, u in zip(self.trackers, uniq):
                    tracker.retire(number, u)
                self._read_one()
        finally:
            for cache in self.caches or []:
                if getattr(cache, "prefetch_owner", None) not in (self, None):
                    continue  # another loop's cache (this one was refused): leave its windows alone
                cache.window_forwards_left = 0
                cache.release_window()  # also unprotects a window planned ahead (overlap), never activated
                cache.prefetch_owner = None
            self.pending = None
            if not self.refused:
                self._notify("on_prefetch_end")

    def _notify(self, hook: str) -> None:
        """Modules that act on the batches themselves (a sharded model, whose input all-to-all ran when a batch
        was read ahead) hear when a batch is yielded and when the loop ends."""
        for module in self.modules:
            fn = getattr(module, hook, None)
            if fn is not None:
                fn()


def prefetch(batches: Iterable, modules: Sequence, depth: int = 4, horizon: int = 64, ids: IdsFn | None = None,
             policy: str | Policy = "lookahead", overlap: bool | None = None) -> Prefetcher:
    """Wrap any iterable of batches so the modules' caches admit each window of `depth` batches in one go,
    evicting with knowledge of the next `horizon` batches' ids. Yields the batches unchanged.

    `modules`: CachedEmbeddingBag / CachedEmbeddingBagCollection instances used by the model. Their ids are
    read from each batch by `module.prefetch_targets(batch)` (a tensor / (input, offsets, ...) tuple for a
    CachedEmbeddingBag; a KeyedJaggedTensor or dict for a collection) or by `ids(batch) -> [one tensor per
    module]`; they must be the ids the forward will look up. Training through prefetch gives the same table as
    training without it.

    `overlap` (default: on for CUDA caches) plans each next window while the current one is in use, when both
    fit in the cache together, and moves its rows on a side stream during the current window's compute.
    """
    return Prefetcher(batches, modules, depth=depth, horizon=horizon, ids=ids, policy=policy, overlap=overlap)
