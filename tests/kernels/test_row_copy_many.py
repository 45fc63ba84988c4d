"""row_copy_many (a cache row's weights, optimizer states and count in one launch) against one row_copy_torch
per pair: copies are exact, so every comparison is bitwise."""
import os

import pytest
import torch

from cachedemb.kernels.row_copy import RowCopy, row_copy_many, row_copy_many_torch, row_copy_many_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="CPU cases run the Triton kernels under TRITON_INTERPRET=1")


def cache_like(n_host=300, n_slots=40, dim=12, cap=32, n_states=2, seed=0):
    """Host tables (bf16 rows, fp32 states of widths dim and 1, int64 counts) and NaN / -7 device tables;
    indices with -1 holes, an out-of-range entry, distinct destinations; a second destination index (counts
    go to other rows than the weights: _copy_out's dirty ids vs all ids)."""
    g = torch.Generator().manual_seed(seed)
    host = [torch.randn(n_host, dim, generator=g).to(torch.bfloat16)]
    host += [torch.rand(n_host, w, generator=g) for w in (dim, 1)[:n_states]]
    host.append(torch.randint(0, 1000, (n_host,), generator=g))
    dev = [torch.full((n_slots,) + t.shape[1:], float("nan"), dtype=t.dtype) if t.is_floating_point()
           else torch.full((n_slots,), -7) for t in host]
    ids = torch.randperm(n_host, generator=g)[:cap]
    ids[::6] = -1
    ids[3] = n_host + 5  # past the end: skipped
    slots = torch.randperm(n_slots, generator=g)[:cap]
    other = torch.where(torch.rand(cap, generator=g) < 0.5, slots, -1)
    return host, dev, ids, slots, other


@pytest.mark.parametrize("n", [32, 17, 0, ("t", 21), ("t", 999)], ids=["all", "int17", "zero", "dev21", "dev999"])
@pytest.mark.parametrize("n_states", [0, 2], ids=["sgd", "adam"])
def test_row_copy_many_fill_and_write_back(n, n_states):
    host, dev, ids, slots, other = cache_like(n_states=n_states)
    n = torch.tensor([n[1]]) if isinstance(n, tuple) else n
    # fill: host rows -> slots, every tensor the same index pair
    fill = [RowCopy(h, ids, d, slots) for h, d in zip(host, dev)]
    ref_dev = [d.clone() for d in dev]
    row_copy_many_torch([RowCopy(h, ids, d, slots) for h, d in zip(host, ref_dev)], n)
    row_copy_many_triton(fill, n)
    for got, ref in zip(dev, ref_dev):
        assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got.nan_to_num(-1.0)
                           if got.is_floating_point() else got,
                           ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref.nan_to_num(-1.0)
                           if ref.is_floating_point() else ref)
    # write back: slots -> host, weights and states to `other`, the count to `ids`
    back = [RowCopy(d, slots, h, other) for d, h in zip(dev[:-1], host[:-1])]
    back.append(RowCopy(dev[-1].clamp(min=0), slots, host[-1], ids))
    ref_host = [h.clone() for h in host]
    row_copy_many_torch([RowCopy(c.src, c.src_idx, r, c.dst_idx) for c, r in zip(back, ref_host)], n)
    row_copy_many(back, n)  # dispatch: torch under no CACHEDEMB_BACKEND on CPU, so also run the Triton path
    row_copy_many_triton(back, n)
    for got, ref in zip(host, ref_host):
        assert torch.equal(got.float().nan_to_num(-1.0), ref.float().nan_to_num(-1.0))


def test_row_copy_many_more_than_four_pairs_and_strided():
    """Six pairs (two launches) and a strided source (that pair goes through row_copy)."""
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(50, w, generator=g) for w in (1, 3, 8, 16, 5)] + [torch.randn(8, 50, generator=g).t()]
    dsts = [torch.zeros(20, s.shape[1]) for s in srcs]
    refs = [d.clone() for d in dsts]
    ids, slots = torch.randperm(50, generator=g)[:15], torch.randperm(20, generator=g)[:15]
    row_copy_many_triton([RowCopy(s, ids, d, slots) for s, d in zip(srcs, dsts)], torch.tensor([12]))
    row_copy_many_torch([RowCopy(s, ids, r, slots) for s, r in zip(srcs, refs)], 12)
    assert all(torch.equal(d, r) for d, r in zip(dsts, refs))
    assert all(int((d != 0).any(1).sum()) == 12 for d in dsts)
