"""Rows a prefetch window admitted, counted as misses of the batch that first looks them up.

A window moves its batches' missing rows in before they run, so their forwards find every row resident. The
same rows came from the host as without prefetch, so `cache_stats()` still counts them as misses: a window marks
the slots it fills, and the first batch that looks a marked slot up takes the mark off and counts it in
`window_misses`, which `EmbeddingCache.stats_dict` moves from `hits` to `misses`. A row admitted by a batch
itself clears its slot's mark (it is that batch's miss already). The marks exist only while a prefetch loop
runs (`EmbeddingCache.release_window` drops them: a row its window admitted and no batch then looked up counts
as neither), and only where counts are on the host: under the CUDA rules, whose launch budget a per-batch gather
would strain, a window's admitted rows count as misses when the window ends (`EmbeddingCache._end_windows`),
which gives the same totals at every window boundary.
"""
from __future__ import annotations

import torch


class WindowMisses:
    """Per-slot marks of rows a window admitted that no batch has looked up yet, for a cache of `capacity`."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        # [C + 2] int64 (0/1): slots, then C (where a move's unused entries mark), then C + 1 (what -1 indexes:
        # always 0, read by the lookups past a batch's distinct ids and by host-served rows)
        self.marks = torch.zeros(capacity + 2, dtype=torch.int64, device=device)

    def nbytes(self) -> int:
        return self.marks.numel() * self.marks.element_size()

    def admitted(self, miss_dest: torch.Tensor, n_miss: torch.Tensor, by_window: bool) -> None:
        """Rows moved into the slots of `miss_dest` (a RowMove's, in miss rank order: a slot per admitted miss,
        -1 for one served from the host, unwritten past `n_miss` under the CUDA rules): marked when a window
        admitted them, unmarked when a batch did."""
        ranks = torch.arange(miss_dest.numel(), device=miss_dest.device)
        dest = torch.where((ranks < n_miss) & (miss_dest >= 0), miss_dest, self.capacity)
        self.marks.index_fill_(0, dest, 1 if by_window else 0)

    def count(self, loc_u: torch.Tensor, counter: torch.Tensor) -> None:
        """A batch's lookups (`loc_u`: a slot per distinct id, negative past them and for host rows): adds to
        `counter` ([1]) the marked slots among them and takes their marks off (five launches)."""
        at = loc_u.clamp(min=-1)
        counter.add_(self.marks[at].sum())
        self.marks.index_fill_(0, at, 0)
