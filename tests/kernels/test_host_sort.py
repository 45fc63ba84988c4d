"""kernels/host_sort.stable_sort against torch.sort(stable=True): the same values and permutation, through numpy's
sort of the packed keys and the torch.sort fallback."""
import pytest
import torch

from cachedemb.kernels.host_sort import stable_sort


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("low,span", [(0, 3), (-1, 100), (-5, 10**6), (2**40, 2**20), (-(2**61), 2**50),
                                      (0, 2**62), (-(2**62), 2**63 - 2**10)])
def test_stable_sort_equals_torch_stable_sort(dtype, low, span):
    g = torch.Generator().manual_seed(low % 1000 + span % 1000)
    for n in (0, 1, 2, 17, 1000, 70_000):
        keys = low + (torch.rand(n, generator=g, dtype=torch.float64) * span).to(torch.int64)
        if dtype == torch.int32:
            keys = keys.clamp(-(2**31), 2**31 - 1).to(torch.int32)
        want = torch.sort(keys, stable=True)
        got = stable_sort(keys)
        assert got[0].dtype == keys.dtype and got[1].dtype == torch.int64
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
        if n:
            bounded = stable_sort(keys, (int(keys.min()), int(keys.max())))
            assert torch.equal(bounded[0], want.values) and torch.equal(bounded[1], want.indices)


def test_stable_sort_keeps_equal_keys_in_input_order():
    keys = torch.tensor([3, 1, 3, 1, 2, 3, 1])
    values, perm = stable_sort(keys)
    assert values.tolist() == [1, 1, 1, 2, 3, 3, 3] and perm.tolist() == [1, 3, 6, 4, 0, 2, 5]


@pytest.mark.parametrize("kbits", [0, 1, 11, 12, 13, 23, 24, 25, 36, 37, 47, 48, 49])
def test_stable_sort_at_many_key_widths(kbits):
    """Keys spanning kbits bits with many repeats, few and many keys."""
    g = torch.Generator().manual_seed(kbits)
    for n in (255, 256, 5000):
        keys = torch.randint(0, 97, (n,), generator=g) * ((1 << kbits) // 97 + 1) if kbits else torch.zeros(n)
        keys = (keys.to(torch.int64).clamp(max=(1 << kbits) - 1) if kbits else keys.to(torch.int64)) - 7
        keys[0], keys[-1] = -7, -7 + (1 << kbits) - 1 if kbits else -7  # the whole span
        want = torch.sort(keys, stable=True)
        got = stable_sort(keys)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
