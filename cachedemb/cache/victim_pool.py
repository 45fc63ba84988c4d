"""Victim choice whose per-batch cost follows the misses: a candidate pool re-scored per batch, ranked in full
only when it runs dry.

A full ranking scores all C slots and takes the k lowest: O(cache) per batch with misses. The pool keeps the P
lowest-scored slots of the last full ranking (P ~ the misses of `batches` batches) and `bound`, the highest
score among them; every slot outside scored above `bound` then. A later batch re-scores only the pool.

Why that is exact: for a `@monotone` policy a slot's score never drops on a recorded use, and the cache's other
writes to slot metadata land in pool slots (admissions take pool victims). So every slot outside the pool still
scores above `bound`, and if the pool holds at least n_admit unprotected scores <= bound, its n_admit lowest
are the whole cache's n_admit lowest. When it does not (drained), the cache is ranked again and the pool
refilled. Whatever can lower a score outside the pool invalidates it (the cache calls `invalidate`): count
halving, window protection dropped, next uses refreshed, rows re-read from the host, an index rebuild that
drops rows, table ranks set, a reload. A full ranking scores slots without this batch's hit protection (a hit
slot's score falls back once the batch is over), then applies it to the pool.

On CPU with counts on the host the drained test is a host branch. Under the CUDA rules (sync-free) it is a
device flag, `drained`: the full ranking is launched every batch with that flag as its gate and `torch.where`
keeps the right choice (static shapes, no host read). On the Triton backend the ranking's O(cache) kernels
(the built-in policies' scores, kernels/slot_score.py, and the radix selection) are persistent programs that do
no work while the gate reads 0, so a batch the pool serves costs O(pool) plus a few idle launches; a custom
policy's torch scoring and the torch reference compute the ranking anyway. The selection is exact either way.

Two levels under the CUDA rules: the static bound on a batch's victims is its lookups, often many times its
misses. The pool is sized by the misses instead (`k1` victims a batch, ~10 batches of them), from miss counts
that reach the host without a sync (cachedemb/cache/miss_estimate.py); a batch admitting more than k1 raises the same
device flag and takes the gated ranking's k victims.
"""
from __future__ import annotations

import numpy as np
import torch

from cachedemb.cache.exact_device import exact_device
from cachedemb.kernels.host_nonzero import nonzero_1d
from cachedemb import kernels
from cachedemb.kernels import PROTECTED
from cachedemb.cache import pool_native
from cachedemb.cache.miss_estimate import MissEstimate
from cachedemb.cache.policy import is_monotone

POOL_BATCHES = 8  # the pool holds about this many batches' worth of victims (under the CUDA rules: ~10, see below)
# Where counts are on the host, fewer: re-scoring the pool every batch costs ~20 ns a slot (random gathers), a full
# ranking ~35 ns a cache slot once per drain. At a 400k-slot cache with one-batch prefetch windows (~12k victims a
# window) 8 batches kept ~130k valid candidates and cost 6.4 ms a choice, 2 batches 3.4 ms (rankings 1 -> 2 in 45
# windows); the per-batch path 2.3 -> 1.6 ms.
HOST_POOL_BATCHES = 2
# A pool of over 1/WHOLE_SHARE of the cache is every slot (where counts are on the host): scoring the whole view in
# order beats gathering that many slots by index (4-batch windows at a 5% cache: 8 ms a choice whole, 11 pooled).
WHOLE_SHARE = 3


class VictimPool:
    """The candidate slots of the last full ranking, their bound, and the policy that ranked them."""

    def __init__(self, capacity: int, device: torch.device, batches: int = POOL_BATCHES):
        if batches < 0:
            raise ValueError(f"the pool holds >= 0 batches of victims, got {batches}")
        self.capacity, self.device, self.batches = int(capacity), exact_device(device), int(batches)
        self.slots = torch.empty(0, dtype=torch.int64, device=self.device)  # [P] candidate slots
        self.bound = torch.full((1,), PROTECTED, dtype=torch.int64, device=self.device)
        self.policy = None  # None: invalid, the next choice ranks every slot
        self.rankings = 0  # full rankings launched so far (host count; gated ones included)
        # under the CUDA rules the pool lives on the device (kernels/slot_rank.py): [n_pool, bound, rankings that
        # ran]; `ranked` (a view) counts the rankings that ran ungated or drained, on either path
        self.state = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.ranked = self.state[2:3]
        self.k1 = 0  # victims the pool serves per batch (CUDA rules), fixed at its ranking
        self.ranked_size = 0  # the pool's size at its last full ranking
        self.misses = MissEstimate(self.device)
        self.device_slots = self.device_score = None  # [C] int64 each, from the first device-side choice
        self.device_policy = None  # the policy the device pool was ranked with; None: stale
        self.device_bound = 0  # host bound on n_pool: the largest target a ranking since the last reset had
        self._mark = None  # [C] bool, all False between unions (`include`)
        # exact path: slots that joined since the last choice (`include`), merged by it (or sooner, see `include`)
        self.joined: list[torch.Tensor] = []
        self._rescore_scratch = None  # [4, n] int64 for `rescore` (union, scores, kept entries and their scores)

    def invalidate(self) -> None:
        self.policy = None
        self.device_policy = None
        self.joined = []

    def include(self, slots: torch.Tensor, exact: bool) -> None:
        """Slots whose scores may have dropped (a prefetch window's protection taken off, its rows' next uses
        moved on) join the candidates, so every slot outside the pool still scores above `bound` and the pool
        stays exact without a full ranking. Under the CUDA rules (`exact` False: merging would need a sort
        with a dynamic size) the pool is invalidated instead. On the exact path they are kept aside until the
        next choice merges them while it re-scores the pool (one pass, `choose`), or merged now where pool and
        joiners together could outgrow what re-scoring pays for."""
        if self.policy is None or self.slots.numel() == self.capacity:
            return
        if not exact:
            self.invalidate()
            return
        self.joined.append(slots)
        if self.slots.numel() + sum(j.numel() for j in self.joined) > 2 * self.ranked_size:
            self._merge()

    def _marks(self) -> torch.Tensor:
        if self._mark is None or self._mark.device != self.device:
            self._mark = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        return self._mark

    def _scratch(self, n: int) -> torch.Tensor:
        if self._rescore_scratch is None or self._rescore_scratch.shape[1] < n:
            self._rescore_scratch = torch.empty(4, max(n, self.capacity // 4), dtype=torch.int64)
        return self._rescore_scratch

    def _joined(self) -> torch.Tensor:
        return self.joined[0] if len(self.joined) == 1 else torch.cat(self.joined)

    def _merge(self) -> None:
        """The joined slots into the pool (a set union); a pool grown past twice its ranking's size is dropped."""
        if not self.joined:
            return
        slots = self._joined()
        self.joined = []
        merged = pool_native.union(self.slots, slots, self.capacity, self._marks())  # O(pool + slots), in C
        if merged is None:
            # A set union as a mask over the slots: O(cache) elementwise, not a sort of pool + window (a sort of
            # ~400k slots took 15 ms on CPU, more than the step it served); sorted slots come out.
            member = self._marks().clone()
            member.index_fill_(0, self.slots, True)
            member.index_fill_(0, slots[(slots >= 0) & (slots < self.capacity)], True)
            merged = nonzero_1d(member)
        if merged.numel() > 2 * self.ranked_size:  # re-scoring it would cost more than a ranking saves
            self.invalidate()
            return
        # a pool of every slot is arange(C) (`choose` scores the whole view then, indexed by slot)
        self.slots = torch.arange(self.capacity, device=self.device) if merged.numel() == self.capacity else merged

    def tensors(self):
        extra = [t for t in (self.device_slots, self.device_score, self._mark, self._rescore_scratch)
                 if t is not None] + self.joined
        return [self.slots, self.bound, self.state] + extra

    def to(self, device) -> None:
        self.device = exact_device(device)
        self.slots, self.bound = self.slots.to(self.device), self.bound.to(self.device)
        self.state = self.state.to(self.device)
        self.ranked = self.state[2:3]
        self.device_slots = self.device_score = self._mark = self._rescore_scratch = None
        self.joined = []
        self.misses = MissEstimate(self.device)
        self.invalidate()

    def pool_size(self, k: int, n_hit: int) -> int:
        """P where counts are on the host: this batch's k victims past its n_hit protected hits, plus `batches`
        (at most HOST_POOL_BATCHES) more batches of k."""
        return min(self.capacity, k + n_hit + min(self.batches, HOST_POOL_BATCHES) * k)

    def observe(self, n_miss: torch.Tensor) -> None:
        """This batch's miss count ([1], or [2]: its hits and misses, on the device), for sizing the pool without
        a host read."""
        self.misses.push(n_miss)

    def sync_free_sizes(self, k: int) -> tuple[int, int]:
        """(k1, P) under the CUDA rules: the victims the pool serves per batch and its size. k1 covers the
        largest recent miss count that reached the host (with a margin, rounded up to a power of two so it
        rarely changes), at most the static bound k; a batch admitting more takes the gated full ranking."""
        seen = self.misses.value()
        k1 = k if seen is None else min(k, 1 << max(4, (seen + seen // 4 + 4 - 1).bit_length()))
        return k1, min(self.capacity, (self.batches + 2) * k1)

    def device_sizes(self, policy, lookups: int) -> tuple[int, int, bool]:
        """Under the CUDA rules, before a batch of `lookups` distinct-id positions: (size, cap, stale). `size` is
        the pool a ranking aims at (~10 batches of the recent misses, sync_free_sizes); a ranking takes
        m = min(C, max(size, n_admit + n_hit)) slots, so n_pool <= cap, the capacity the batch's check covers.
        `stale`: the device pool cannot serve (invalidated, another or an unmarked policy, or 2x larger than the
        recent misses need: the next batch with misses ranks again)."""
        if self.device_slots is None:
            self.device_slots = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
            self.device_score = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        _, size = self.sync_free_sizes(max(1, min(lookups, self.capacity)))
        target = min(self.capacity, max(size, lookups))
        stale = self.device_policy is None or policy is not self.device_policy or not is_monotone(policy)
        if not stale and self.device_bound > 2 * target:
            stale = True
        self.device_bound = target if stale else max(self.device_bound, target)
        self.device_policy = policy if is_monotone(policy) else None
        self.rankings += 1
        return size, self.device_bound, stale

    def choose(self, policy, view_of, unprotect_hits, protected, k: int,
               n_admit: torch.Tensor, n_hit: int, exact: bool, score_all=None, score_of=None,
               rescore=None, drop_protected: bool = False) -> torch.Tensor:
        """The k lowest-scored slots under `protected(slots)` (window + this batch's hits, a bool per slot),
        lowest first; exactly the full ranking's first n_admit. `view_of(slots, protected)` builds a SlotView
        (slots None: all C); `unprotect_hits(score)` takes this batch's hit protection off full-view scores in
        place (O(hits)); `score_all(policy, protected, gate)` scores all C slots, free to skip the work while
        the [1] flag `gate` reads 0 (default: the policy over view_of(None, protected)). With `exact` (counts on
        the host) fewer than k victims may come back, never fewer than n_admit; without, exactly k (those
        past n_admit are valid slots, not ranked). `score_of(policy, slots, protected)`, when given, scores the
        pool instead of the policy over view_of(slots, protected) (the same scores, faster).
        `rescore(policy, pool, joined, bound, mark, scratch, drop_protected)`, when given, does the exact path's
        union with the joined slots, scores, valid count and pruning in one pass (a `pool_native.Rescored`, or
        None: the steps one by one); a pool of every slot is scored as a whole instead (no union, no gathers by
        slot). `drop_protected` (exact path): every slot protected now joins the pool again when its protection
        comes off (a prefetch window's slots, this window's hits among them), so the pruning drops protected
        entries too; the per-batch path keeps them (its hits' protection ends without a join)."""
        if score_of is None:
            def score_of(policy, slots, protected):
                return policy(view_of(slots, protected))
        if score_all is None:
            def score_all(policy, protected, gate):
                return policy(view_of(None, protected))
        if exact:
            k1, size = k, self.pool_size(k, n_hit)
        else:
            k1, size = self.sync_free_sizes(k)
        # Under the CUDA rules the pool keeps its ranking's sizes until more misses than it serves are seen, or
        # it is 2x or more larger than the recent misses need: then one ungated ranking resizes it.
        usable = (is_monotone(policy) and policy is self.policy and (self.slots.numel() > 0 or bool(self.joined))
                  and (exact or (k1 <= self.k1 and 2 * size > self.slots.numel())))
        if usable and exact and rescore is not None and self.slots.numel() < self.capacity:
            joined = self._joined() if self.joined else self.slots[:0]
            fused = rescore(policy, self.slots, joined, int(self.bound), self._marks(),
                            self._scratch(self.slots.numel() + joined.numel()), drop_protected)
            if fused is not None:
                self.joined = []
                if fused.n_valid < int(n_admit):  # drained
                    return self._rank(policy, score_all, unprotect_hits, protected, k, k1, size, exact)
                return self._served(fused, k)
        if self.joined:
            self._merge()
            usable = usable and policy is self.policy and self.slots.numel() > 0
        if usable:
            pool = self.slots
            # A pool of every slot is arange(C) (see _rank): score the whole view, no gathers by slot
            whole = pool.numel() == self.capacity
            score = score_all(policy, protected(None), None) if whole else score_of(policy, pool, protected(pool))
            if exact:
                if _count_valid(score, self.bound) >= int(n_admit):
                    victims = pool[kernels.victim_select(score, min(k, pool.numel()), exact)]
                    if not whole:
                        self._prune(pool, score, drop_protected)
                    return victims
            else:
                # the pool's k1 lowest serve a batch admitting <= k1 while it holds enough scores <= its bound;
                # else the gated ranking's k victims (k1 and the pool's size stay the last ranking's)
                n_valid = ((score <= self.bound) & (score < PROTECTED)).sum().reshape(1)
                k1 = min(self.k1, k)
                from_pool = pool[kernels.victim_select(score, k1)]
                from_pool = torch.cat([from_pool, from_pool.new_zeros(k - k1)])
                drained = (n_valid < n_admit) | (n_admit > k1)
                old_slots, old_bound = self.slots, self.bound
                victims = self._rank(policy, score_all, unprotect_hits, protected, k, k1, pool.numel(), exact,
                                     gate=drained)
                self.slots = torch.where(drained, self.slots, old_slots)
                self.bound = torch.where(drained, self.bound, old_bound)
                return torch.where(drained, victims, from_pool)
        return self._rank(policy, score_all, unprotect_hits, protected, k, k1, size, exact)

    def _served(self, fused, k: int) -> torch.Tensor:
        """The k lowest of a re-scored pool (`rescore`), which becomes its kept entries. Where the k lowest are
        all valid they are the kept entries' k lowest (every valid score is kept), a shorter selection."""
        k = min(k, fused.union.numel())
        if fused.union.numel() == self.capacity:  # every slot (as `include` leaves it): kept whole, unpruned
            # (the union and scores are views of the scratch: select before anything reuses it)
            self.slots = torch.arange(self.capacity, device=self.device)
            return fused.union[kernels.victim_select(fused.score, k, True)]
        self.slots = fused.kept
        if k <= fused.n_valid:
            return fused.kept[kernels.victim_select(fused.kept_score, k, True)]
        return fused.union[kernels.victim_select(fused.score, k, True)]

    def _prune(self, pool: torch.Tensor, score: torch.Tensor, drop_protected: bool = False) -> None:
        """Drop the candidates that score above `bound` (exact path): a monotone score does not come back down
        while the slot keeps its id and protection, and whatever lowers it makes the slot join again (`include`)
        or invalidates the pool, so every slot outside still scores above `bound`. Protected scores stay (a
        batch's hit protection is taken off again without an `include`). This batch's victims score <= bound and
        stay: their new rows' scores are unknown here. Without it every prefetch window's slots, included when
        its protection comes off, stay in the pool to be re-scored each batch (mostly rows used again soon,
        far above the bound) until the pool doubles and a full ranking is forced. With `drop_protected` the
        protected candidates go too (see `choose`): at a 5% cache with one-batch windows they were ~26k of a
        ~68k-entry pool, re-scored every window."""
        keep = score <= self.bound
        if not drop_protected:
            keep |= score >= PROTECTED
        self.slots = pool.masked_select(keep)

    def _rank(self, policy, score_all, unprotect_hits, protected, k, k1, size, exact, gate=None) -> torch.Tensor:
        """Score every slot (window protection only), keep the `size` lowest as the pool (serving k1 victims a
        batch), and return this batch's k victims (its hits protected). With a `gate` ([1] bool) the results
        only count where it is set (the caller keeps them with torch.where) and the O(cache) work may be
        skipped where it is not."""
        self.joined = []  # every slot is scored
        all_protected = protected(None)
        score = score_all(policy, all_protected, gate)
        unprotect_hits(score)
        self.ranked_size = size
        if size < self.capacity and not (exact and WHOLE_SHARE * size >= self.capacity):
            self.slots = kernels.victim_select(score, size, exact, gate=gate)  # ascending score
            self.bound = score[self.slots[-1:]]
        else:  # every slot is a candidate (no order needed): nothing outside to stay below
            self.slots = torch.arange(self.capacity, device=self.device)
            self.bound = torch.full((1,), PROTECTED - 1, dtype=torch.int64, device=self.device)
        self.policy = policy if is_monotone(policy) else None
        if gate is None:  # a gated ranking keeps the pool's sizes (the flag decides which pool stands)
            self.k1 = k1
        self.rankings += 1
        self.ranked += 1 if gate is None else gate.to(torch.int64)
        if k <= size:
            in_batch = torch.where(protected(self.slots), torch.full_like(self.slots, PROTECTED), score[self.slots])
            return self.slots[kernels.victim_select(in_batch, min(k, size), exact, gate=gate)]
        # a pool smaller than this batch's static bound (CUDA rules): its victims from every slot
        in_batch = torch.where(all_protected, torch.full_like(score, PROTECTED), score)
        return kernels.victim_select(in_batch, k, exact, gate=gate)


def _count_valid(score: torch.Tensor, bound: torch.Tensor) -> int:
    """How many scores are <= `bound` and not protected, read on the host (the exact path): one numpy pass on
    CPU (the torch expression is three passes and a sum, ~0.7 ms over a 400k-slot cache)."""
    if score.device.type == "cpu" and score.dtype == torch.int64 and not score.requires_grad:
        return int(np.count_nonzero(score.contiguous().numpy() <= min(int(bound), PROTECTED - 1)))
    return int(((score <= bound) & (score < PROTECTED)).sum())
