"""GPU-only checks (skipped without CUDA): a steady-state training step makes no host sync, the table stays in
pinned host memory, and cached training on the GPU equals full-table training."""
import pytest
import torch

import cachedemb
from cachedemb import optim

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_steady_state_training_step_has_no_host_sync():
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(200_000, 64, mode="sum", cache_rows=20_000, device="cuda",
                                       optimizer=optim.RowWiseAdagrad(lr=0.05), validate_inputs=False)
    assert emb.cache.host_weight.is_pinned() and emb.cache.host_weight.device.type == "cpu"
    offsets = torch.arange(0, 4096 * 8, 8, device="cuda")
    batches = [torch.randint(0, 200_000, (4096 * 8,), device="cuda") for _ in range(4)]
    for ids in batches[:3]:
        emb(ids, offsets).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        emb(batches[3], offsets).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_gpu_training_equals_full_table(mode):
    torch.manual_seed(0)
    ref = torch.nn.EmbeddingBag(5000, 32, mode=mode, sparse=False).cuda()
    ours = cachedemb.CachedEmbeddingBag(5000, 32, mode=mode, cache_rows=50, device="cuda",
                                        optimizer=optim.SGD(lr=0.1), _weight=ref.weight.detach().cpu().clone())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(50):
        ids = (torch.rand(2048, device="cuda") ** 3 * 5000).long()
        offsets = torch.arange(0, 2048, 8, device="cuda")
        opt.zero_grad()
        ref(ids, offsets).tanh().sum().backward()
        opt.step()
        ours(ids, offsets).tanh().sum().backward()
    torch.testing.assert_close(ours.weight, ref.weight.detach().cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
def test_prefetch_on_gpu_is_exact(overlap):
    """Side-stream window transfers racing the compute stream would show up as a different table."""
    torch.manual_seed(0)
    batches = [((torch.rand(8192) ** 2 * 60_000).long(), torch.arange(0, 8192, 4)) for _ in range(60)]

    def run(use_prefetch):
        torch.manual_seed(1)
        emb = cachedemb.CachedEmbeddingBag(60_000, 128, mode="sum", cache_rows=20_000, device="cuda",
                                           optimizer=optim.Adam(lr=0.01))
        source = (cachedemb.prefetch(batches, [emb], depth=4, horizon=16, overlap=overlap) if use_prefetch
                  else batches)
        for ids, offsets in source:
            emb(ids.cuda(non_blocking=True), offsets.cuda()).tanh().sum().backward()
        return emb.weight.clone(), emb.cache_stats()

    (with_pipe, stats), (without, _) = run(True), run(False)
    assert stats["windows"] > 0
    torch.testing.assert_close(with_pipe, without, rtol=1e-5, atol=1e-5)
