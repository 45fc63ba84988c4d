"""A read-ahead batch's unique slab rows, as the inner forward's `kernels.unique_ids(rows, None,
return_groups=True)` would compute them, from the sort of its table ids the mapper already did.

The file tier maps each distinct table id of a batch to a slab row; the inner module then looks the batch up by
slab row and would sort those lookups again. The rows are distinct, so sorting just the distinct rows (n, not B)
and moving each id's run of lookups to its row's place gives the same unique ids, inverse, counts and lookup
groups (the tests compare them with `unique_ids`). A C pass for the O(B) part was measured and dropped: about
2 ms a batch saved at an 8M-row table, on the read-ahead thread (benchmarks/results/native_helpers_cpu.json).
"""
from __future__ import annotations

import numpy as np
import torch

from cachedemb.kernels.host_sort import stable_sort


def slab_unique_torch(rows: np.ndarray, inverse: np.ndarray, perm: torch.Tensor, counts: torch.Tensor,
                      order: torch.Tensor) -> tuple:
    n, B = rows.size, inverse.size
    rank = torch.empty(n, dtype=torch.int64)
    rank[order] = torch.arange(n, dtype=torch.int64)
    inv = rank.index_select(0, torch.from_numpy(inverse))
    cnt = counts.index_select(0, order)
    run_start = (torch.cumsum(counts, 0) - counts).index_select(0, order)
    shift = torch.repeat_interleave(run_start - (torch.cumsum(cnt, 0) - cnt), cnt, output_size=B)
    out_perm = perm.index_select(0, shift + torch.arange(B, dtype=torch.int64))
    uniq = torch.full((B,), -1, dtype=torch.int64)
    uniq[:n] = torch.from_numpy(rows).index_select(0, order)
    count_buf = torch.zeros(B, dtype=torch.int64)
    count_buf[:n] = cnt
    ptr = torch.cat([count_buf.new_zeros(1), torch.cumsum(count_buf, 0)])
    return uniq, inv, count_buf, torch.tensor([n], dtype=torch.int64), (out_perm, ptr)


def slab_unique(rows: np.ndarray, inverse: np.ndarray, perm: torch.Tensor, counts: torch.Tensor) -> tuple:
    """unique_ids' (uniq, inverse, counts, n_uniq, (perm, ptr)) of the lookups `rows[inverse]`, where `rows` are
    distinct (int64) and (perm, counts) come from the stable sort of the ids whose distinct positions
    `inverse` gives (every lookup kept)."""
    n, B = rows.size, inverse.size
    order = stable_sort(torch.from_numpy(rows), (0, int(rows.max())))[1].to(torch.int64)
    return slab_unique_torch(rows, inverse, perm, counts, order)
