"""kernels/host_rows.py: the C row copy of the torch path gives what the torch code gives (pairs out of range
skipped, only the first n, any row width and dtype), and declines where it does not apply."""
from __future__ import annotations

import pytest
import torch

from cachedemb.kernels import host_rows
from cachedemb.kernels.row_copy import RowCopy, row_copy_many_torch, row_copy_torch

pytestmark = pytest.mark.skipif(host_rows.NATIVE.get() is None, reason="C helpers off: the torch code runs")


def _torch(fn, monkeypatch):
    monkeypatch.setattr(host_rows.NATIVE, "enabled", False)
    try:
        fn()
    finally:
        monkeypatch.setattr(host_rows.NATIVE, "enabled", True)


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.float64, 3), (torch.int64, 1), (torch.bool, 5),
                                       (torch.float16, 7)])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_the_c_copy_equals_the_torch_copy(dtype, dim, idx_dtype, monkeypatch):
    g = torch.Generator().manual_seed(dim)
    src = (torch.randn(50, dim, generator=g) * 10).to(dtype)
    dst_c, dst_t = torch.zeros(40, dim, dtype=dtype), torch.zeros(40, dim, dtype=dtype)
    src_idx = torch.randint(-3, 55, (30,), generator=g).to(idx_dtype)  # some out of range on either side
    dst_idx = torch.randperm(46, generator=g)[:30].sub(3).to(idx_dtype)  # distinct, some out of range
    for n in (30, 17, torch.tensor([11]), 0):
        dst_c.zero_(), dst_t.zero_()
        assert host_rows.copy_rows(src, src_idx, dst_c, dst_idx, n)
        _torch(lambda: row_copy_torch(src, src_idx, dst_t, dst_idx, n), monkeypatch)
        assert torch.equal(dst_c, dst_t)
    ones = torch.ones(40, dtype=dtype)  # a 1-D table (a count per row) goes as rows of one
    ref = torch.ones(40, dtype=dtype)
    row_copy_torch(src[:, 0].contiguous(), src_idx, ones, dst_idx, 30)
    _torch(lambda: row_copy_torch(src[:, 0].contiguous(), src_idx, ref, dst_idx, 30), monkeypatch)
    assert torch.equal(ones, ref)


def test_row_moves_through_row_copy_many_equal_the_torch_code(monkeypatch):
    g = torch.Generator().manual_seed(0)
    host, states, counts = torch.randn(100, 8, generator=g), torch.rand(100, 1, generator=g), torch.arange(100)
    rows, slot_states, slot_counts = torch.randn(20, 8, generator=g), torch.rand(20, 1, generator=g), torch.arange(20)
    victims, ids = torch.randperm(20, generator=g)[:12], torch.randperm(100, generator=g)[:12]
    ids[3] = -1
    out = []
    for use_c in (True, False):
        h, s, c = host.clone(), states.clone(), counts.clone()
        copies = [RowCopy(rows, victims, h, ids), RowCopy(slot_states, victims, s, ids),
                  RowCopy(slot_counts, victims, c, ids)]
        if use_c:
            row_copy_many_torch(copies, torch.tensor([9]))
        else:
            _torch(lambda: row_copy_many_torch(copies, torch.tensor([9])), monkeypatch)
        out.append((h, s, c))
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_the_c_copy_declines_what_it_cannot_do_alike():
    t = torch.arange(40.0).reshape(10, 4)
    idx = torch.arange(5)
    assert not host_rows.copy_rows(t, idx, t, idx + 5, 5)  # overlapping memory: gather-then-scatter order matters
    assert not host_rows.copy_rows(t, idx, torch.zeros(10, 4, dtype=torch.float64), idx, 5)  # dtypes differ
    assert not host_rows.copy_rows(t.t(), idx, torch.zeros(4, 10), idx[:4], 4)  # not contiguous
    assert torch.equal(t, torch.arange(40.0).reshape(10, 4))


def test_a_c_copy_bumps_the_version_as_an_in_place_op_does():
    dst = torch.zeros(6, 3)
    before = dst._version
    assert host_rows.copy_rows(torch.ones(6, 3), torch.arange(3), dst, torch.arange(3), 3)
    assert dst._version > before and dst[:3].eq(1).all() and dst[3:].eq(0).all()
