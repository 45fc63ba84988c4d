"""The overlap decisions of the prefetch pipeline as plain logic: which window's rows move when, on which stream,
which rows stay locked, how many staging slots a cache gets, and how a host tensor reaches a device. The pipeline
(pipeline.py) acts on them and logs one `WindowDecision` per window; the tests check them on CPU
(docs/prefetch.md has the timeline).

The overlap test counts the union of the window in use (A, locked until its last backward) and the next one (B):
B's rows can move while A computes when |A| + |B - A| = |A or B| <= the cache's slots, `cache_rows` plus its
staging slots. The staging slots hold B's new rows; at B's activation the cache trims itself back to `cache_rows`
resident rows (EmbeddingCache.trim_resident), evicting what a cache of `cache_rows` would have evicted for B.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SIDE, CURRENT, NONE = "side", "current", "none"


@dataclass(frozen=True)
class WindowDecision:
    """How one window was admitted (per cache: tuples in the pipeline's cache order).

    `planned_at`: the batch at whose window start it was planned (its own start when admitted there); `stream`:
    SIDE (rows moved while the window before it computed: a CUDA side stream, or the host copy thread on CPU),
    CURRENT (moved in order at its start, or at once on the training thread) or NONE (no window: the batch took
    the per-batch path); `locked_rows`: rows of the window in use kept from being victims while this one's rows
    moved (0 when not overlapped); `why`: what kept it from overlapping ('' when it overlapped)."""

    start: int
    count: int
    planned_at: int
    stream: str
    overlapped: bool
    rows: tuple[int, ...]  # |B|
    new_rows: tuple[int, ...]  # |B - A|, A the window before it
    union_rows: tuple[int, ...]  # |A or B| (|B| when A is no window)
    locked_rows: tuple[int, ...]
    slots: tuple[int, ...]  # the caches' slots when it was planned (cache_rows + staging)
    why: str = ""


def fits_beside(locked: int, new: int, slots: int) -> bool:
    """Whether a window adding `new` rows to the `locked` rows of the window in use fits in `slots` slots: the
    union test (every row of both resident at once, none of the locked ones a victim, no row served from the
    host). The sum of the two windows' rows counts their shared rows twice and refuses windows that fit."""
    return locked + new <= slots


def staging_rows_for(staging, cache_rows: int) -> int:
    """The staging slots a cache of `cache_rows` rows gets for `staging`: an int is rows per cache, a float in
    [0, 1] a share of each cache's rows (rounded up). The rule: a bound on a window's new rows (|B - A|): a
    batch's misses. With fewer, a window whose new rows pass the free slots evicts rows no window uses at once
    (still exact, no locked row a victim, but more rows moved than a cache of `cache_rows` would move)."""
    if isinstance(staging, bool) or not isinstance(staging, (int, float)):
        raise ValueError(f"staging_rows must be an int >= 0 (rows per cache) or a float in [0, 1] (a share of "
                         f"each cache's rows), got {staging!r}")
    if isinstance(staging, float):
        if not 0.0 <= staging <= 1.0 or math.isnan(staging):
            raise ValueError(f"staging_rows as a share of each cache's rows must be in [0, 1], got {staging!r}")
        return math.ceil(staging * cache_rows)
    if staging < 0:
        raise ValueError(f"staging_rows must be >= 0, got {staging!r}")
    return staging


@dataclass(frozen=True)
class CopyPlan:
    """How a host tensor is sent to a device: through pinned memory (`pin`: the source is pageable and is first
    copied into pinned memory), then without blocking the host. Nothing to do for a tensor already there."""

    copy: bool
    pin: bool
    non_blocking: bool


def copy_plan(t: torch.Tensor, device: torch.device) -> CopyPlan:
    """The host-to-device rule of the hot path: a CUDA destination is written by a non-blocking DMA from pinned
    memory (a pageable source is staged into pinned memory first, on the host; a non-blocking copy from pageable
    memory would be a synchronous staged copy); elsewhere the tensor is used or copied as it is."""
    device = torch.device(device)
    if t.device == device or (device.type == t.device.type and device.index is None):
        return CopyPlan(False, False, False)
    if device.type == "cuda" and t.device.type == "cpu":
        return CopyPlan(True, not t.is_pinned() if torch.cuda.is_available() else True, True)
    return CopyPlan(True, False, False)


class CopyLog:
    """The host-to-device copies the pipeline issued on its hot path: (site, plan) pairs, for tests and reports;
    `check()` raises on any that was blocking or read pageable memory."""

    def __init__(self):
        self.copies: list[tuple[str, CopyPlan]] = []

    def record(self, site: str, plan: CopyPlan) -> None:
        if plan.copy:
            self.copies.append((site, plan))

    def check(self) -> None:
        bad = [(site, plan) for site, plan in self.copies if plan.copy and not plan.non_blocking]
        if bad:
            raise AssertionError(f"blocking host-to-device copies on the prefetch hot path: {bad}")


def to_device(t: torch.Tensor, device: torch.device, log: CopyLog | None = None, site: str = "") -> torch.Tensor:
    """`t` on `device` by `copy_plan` (pinned, non-blocking to a CUDA device), the copy recorded in `log`."""
    plan = copy_plan(t, device)
    if log is not None:
        log.record(site, plan)
    if not plan.copy:
        return t
    if plan.pin:
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=plan.non_blocking)
