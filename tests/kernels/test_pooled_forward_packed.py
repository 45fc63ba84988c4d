"""The pooled forward packs several bags per program below 64 columns (a [bags, D] tile stepping through the
bags' lookups together): the GPU's packing (CACHEDEMB_GPU_SHAPES=1) and the interpreter's give the same bits,
equal to the reference (bitwise for max, 1e-6 for fp32 sums as in test_bag_ops), with ragged bag lengths, a
partial last tile, padding lookups and rows served from the host."""
import os

import pytest
import torch

from cachedemb import kernels
from cachedemb.kernels import MODE_MAX, MODE_MEAN, MODE_SUM
from cachedemb.kernels.pooled_forward import _forward_block_d, forward_bags_per_program, pooled_forward_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="CPU cases run the Triton kernels under TRITON_INTERPRET=1")


@pytest.mark.parametrize("dim", [3, 16, 30])
@pytest.mark.parametrize("mode", [MODE_SUM, MODE_MEAN, MODE_MAX], ids=["sum", "mean", "max"])
def test_packed_forward(mode, dim, monkeypatch):
    g = torch.Generator().manual_seed(dim)
    lengths = torch.randint(0, 10, (37,), generator=g)
    lengths[5] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    _, inverse, _, n_uniq = kernels.unique_ids_torch(ids, padding_idx=2)
    n = int(n_uniq)
    rows = torch.randn(24, dim, generator=g)
    host = torch.randn(40, dim, generator=g)
    loc_u = torch.full((ids.numel(),), -1, dtype=torch.int64)
    loc_u[:n] = torch.randperm(24, generator=g)[:n]
    loc_u[:n:3] = kernels.host_loc(torch.randperm(40, generator=g)[: len(range(0, n, 3))])  # served from host
    psw = torch.rand(ids.numel(), generator=g) if mode == MODE_SUM else None
    assert forward_bags_per_program(_forward_block_d(dim), torch.device("cpu")) > 1
    got, got_pos = pooled_forward_triton(rows, loc_u, inverse, offsets, mode, psw, host)
    monkeypatch.setenv("CACHEDEMB_GPU_SHAPES", "1")  # the GPU's packing: fewer bags per program
    assert forward_bags_per_program(_forward_block_d(dim), torch.device("cpu")) > 1
    gpu, gpu_pos = pooled_forward_triton(rows, loc_u, inverse, offsets, mode, psw, host)
    # each bag sums in lookup order whatever the packing: the same bits
    assert torch.equal(got, gpu)
    ref_out, ref_pos = kernels.pooled_forward_torch(rows, loc_u, inverse, offsets, mode, psw, host)
    if mode == MODE_MAX:  # a copy: bitwise
        assert torch.equal(got, ref_out) and torch.equal(got_pos, ref_pos) and torch.equal(gpu_pos, ref_pos)
    else:  # the fp32 reference pools with torch.embedding_bag (vectorized, may fuse multiply-adds)
        torch.testing.assert_close(got, ref_out, atol=1e-6, rtol=1e-6)

