"""victim_select's CPU k-smallest (one sort of a threshold cut's candidates, or a numpy partition then a sort of the k)
equals torch.topk(largest=False)."""
import pytest
import torch

from cachedemb.kernels.victim_select import PROTECTED, _k_smallest, victim_select_torch


@pytest.mark.parametrize("n", [1, 2, 100, 80_000, 200_000])
def test_k_smallest_equals_topk(n):
    g = torch.Generator().manual_seed(n)
    score = (torch.randint(-(1 << 40), 1 << 40, (n,), generator=g) << 20) | torch.arange(n)  # distinct
    score[torch.randperm(n, generator=g)[: n // 3]] = PROTECTED - torch.arange(n // 3)
    for k in {0, 1, n // 7, n // 4, n - 1, n}:
        want = torch.topk(score, k, largest=False, sorted=True).indices
        assert torch.equal(_k_smallest(score, k), want)
        assert torch.equal(victim_select_torch(score, k, host_sizes=True), want)
