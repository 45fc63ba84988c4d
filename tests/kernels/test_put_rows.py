"""kernels.gather.put_rows: the CPU row scatter the reference ops write rows back with equals index_copy_ bit for
bit (every dtype, 1-D and 2-D, -0.0 and NaN kept) and bumps the destination's version as an in-place op does."""
import pytest
import torch

from cachedemb.kernels.gather import put_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("cols", [None, 1, 7])
def test_put_rows_equals_index_copy(dtype, cols):
    g = torch.Generator().manual_seed(0)
    shape = (50,) if cols is None else (50, cols)
    dst = (torch.randn(shape, generator=g) * 100).to(dtype)
    rows = (torch.randn((20,) + shape[1:], generator=g) * 100).to(dtype)
    if dtype.is_floating_point:
        rows.view(-1)[:3] = torch.tensor([-0.0, float("nan"), float("-inf")]).to(dtype)
    index = torch.randperm(50, generator=g)[:20]
    want = dst.clone().index_copy_(0, index, rows)
    version = dst._version
    put_rows(dst, index, rows)
    assert torch.equal(dst.view(torch.int16 if dtype.itemsize == 2 else torch.int64 if dtype.itemsize == 8
                                else torch.int32), want.view(torch.int16 if dtype.itemsize == 2 else
                                                             torch.int64 if dtype.itemsize == 8 else torch.int32))
    assert dst._version > version


def test_put_rows_invalidates_a_saved_tensor():
    """An autograd graph that saved the destination sees the write, as with index_copy_."""
    w = torch.randn(10, 4, requires_grad=True)
    table = w.detach().clone()
    x = torch.randn(10, 4, requires_grad=True)
    y = (x * table).sum()  # saves `table`
    put_rows(table, torch.tensor([2]), torch.zeros(1, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
