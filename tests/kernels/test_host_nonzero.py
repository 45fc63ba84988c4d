"""nonzero_1d equals torch.nonzero on every mask shape it takes (dense, sparse, empty, all set, strided views)."""
import pytest
import torch

from cachedemb.kernels.host_nonzero import nonzero_1d


@pytest.mark.parametrize("size", [0, 1, 7, 1000, 70_000])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_positions_equal_torch_nonzero(size, density):
    gen = torch.Generator().manual_seed(size + int(100 * density))
    mask = torch.rand(size, generator=gen) < density
    got = nonzero_1d(mask)
    assert got.dtype == torch.int64 and torch.equal(got, mask.nonzero().squeeze(1))


def test_strided_and_derived_masks():
    base = torch.rand(2000, 3, generator=torch.Generator().manual_seed(1)) < 0.4
    for mask in (base[:, 1], base[::3, 0], base.all(1), base[:, 2].logical_not()):
        assert torch.equal(nonzero_1d(mask), mask.nonzero().squeeze(1))


def test_result_is_not_a_view_the_mask_can_change():
    mask = torch.tensor([True, False, True])
    got = nonzero_1d(mask)
    mask.fill_(False)
    assert got.tolist() == [0, 2]
