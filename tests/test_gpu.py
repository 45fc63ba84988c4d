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


def test_host_tables_are_exact_size_and_registered():
    """25.6 GB must not pin 32 GB: the host table, states and counts are exact-size, page-locked memory
    (cudaHostRegister), not blocks of the power-of-two caching host allocator."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats()["allocated_bytes.current"] if stats else None
    rows, dim = 3_000_001, 24
    emb = cachedemb.CachedEmbeddingBag(rows, dim, mode="sum", cache_rows=1000, device="cuda",
                                       optimizer=optim.Adam(0.01))
    cache = emb.cache
    for t, row_bytes in [(cache.host_weight, dim * 4), (cache.host_freq, 8)] + \
            [(s, dim * 4) for s in cache.host_states.values()]:
        assert t.is_pinned() and t.device.type == "cpu"
        assert t.untyped_storage().nbytes() == rows * row_bytes
    if stats:
        assert stats()["allocated_bytes.current"] - before < 64 << 20  # nothing table-sized from that allocator
    ids = torch.randint(0, rows, (4096,), device="cuda")
    emb(ids, torch.arange(0, 4096, 4, device="cuda")).sum().backward()
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_module_on_second_gpu_launches_there():
    """One GPU per rank: a module on cuda:1 works while cuda:0 is current, and equals the same module on cuda:0."""
    torch.manual_seed(0)
    base = torch.randn(5000, 16)
    outs = []
    for dev in ("cuda:0", "cuda:1"):
        emb = cachedemb.CachedEmbeddingBag(5000, 16, mode="mean", cache_rows=64, device=dev,
                                           optimizer=optim.Adagrad(0.1), _weight=base.clone())
        with torch.cuda.device(0):
            for step in range(5):
                g = torch.Generator().manual_seed(step)
                ids = torch.randint(0, 5000, (2048,), generator=g).to(dev)
                emb(ids, torch.arange(0, 2048, 8, device=dev)).sum().backward()
            outs.append(emb.weight.clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_production_batch_fits_in_device_memory():
    """A Criteo-1TB-like multi-hot batch: 40M lookups over ~1M distinct ids, a 2M-row cache of dim 128 with
    Adam. Peak device memory stays O(cache + lookups as ids), never lookups x dim (which alone would be 20 GB)."""
    rows, dim, cache_rows, lookups = 4_000_000, 128, 2_000_000, 40_000_000
    emb = cachedemb.CachedEmbeddingBag(rows, dim, mode="sum", cache_rows=cache_rows, device="cuda",
                                       optimizer=optim.Adam(0.001), validate_inputs=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = (torch.rand(lookups, device="cuda", generator=g) ** 8 * rows).long()
    offsets = torch.arange(0, lookups, 100, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(2):
        emb(ids, offsets).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = emb.cache_stats()["device_bytes"]
    distinct = int(torch.unique(ids).numel())
    print(f"\nproduction batch: {lookups} lookups, {distinct} distinct, cache {held / 2**30:.2f} GiB, "
          f"transient peak {peak / 2**30:.2f} GiB ({peak / lookups:.0f} B per lookup)")
    assert peak < 24 * 2**30
    assert peak < lookups * 400  # a [lookups, 128] fp32 buffer alone would be 512 B per lookup


def test_fixed_shape_training_step_replays_in_a_cuda_graph():
    """A training step with fixed shapes (all ids resident after warm-up, fused SGD) captured once in a CUDA
    graph and replayed on new batches written into the static input equals the same steps run eagerly: the
    kernels' grids and buffers depend on shapes only (persistent grids, device-side counts), never on values."""
    def make():
        torch.manual_seed(0)
        return cachedemb.CachedEmbeddingBag(10_000, 32, mode="sum", cache_rows=4096, device="cuda",
                                            optimizer=optim.SGD(lr=0.05), validate_inputs=False)

    g = torch.Generator(device="cuda").manual_seed(0)
    warm = torch.arange(2048, device="cuda")  # admits every id the batches below use
    batches = [torch.randint(0, 2048, (4096,), device="cuda", generator=g) for _ in range(5)]
    offsets = torch.arange(0, 4096, 8, device="cuda")
    eager, graphed = make(), make()

    def step(m, ids):
        m(ids, offsets).square().sum().backward()

    static_ids = batches[0].clone()
    for m in (eager, graphed):
        step(m, warm)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks before capture
        step(graphed, static_ids)
    torch.cuda.current_stream().wait_stream(side)
    step(eager, batches[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, static_ids)
    for ids in batches[1:]:
        static_ids.copy_(ids)
        graph.replay()
        step(eager, ids)
    torch.cuda.synchronize()
    assert torch.equal(graphed.weight.detach(), eager.weight.detach())


@pytest.mark.parametrize("overlap,staging", [(False, 0), (True, 0.5)], ids=["in-order", "staged-overlap"])
def test_prefetch_window_step_replays_in_a_cuda_graph(overlap, staging):
    """With prefetch (sync-free sizing, as on every CUDA cache; validate_inputs=False; static shapes) the step of a
    batch inside an admitted window (its ids resident and protected: lookup, pooled forward, fused backward, no
    victim choice) captured once in a CUDA graph and replayed on later batches, written into the static input,
    trains exactly as the same steps run eagerly. Window admission runs in the pipeline's `next()`, between
    steps, outside the graph; no launch of the step reads a value on the host or sizes a grid by one. The capture
    runs inside `loop.paused()`: the device read-ahead thread makes no CUDA call meanwhile (in the default global
    capture mode another thread's event wait or pinned allocation fails the capture). With the staged overlap the
    next window's rows move on a side stream while the replayed step computes (the staging slots are reserved
    when the loop starts, before the capture, so the graph's addresses stay valid)."""
    rows, dim, lookups = 50_000, 32, 4096
    g = torch.Generator().manual_seed(0)
    batches = [((torch.rand(lookups, generator=g) ** 3 * rows).long(), torch.arange(0, lookups, 8))
               for _ in range(14)]
    offsets = torch.arange(0, lookups, 8, device="cuda")

    def make():
        torch.manual_seed(0)
        return cachedemb.CachedEmbeddingBag(rows, dim, mode="sum", cache_rows=8192, device="cuda",
                                            optimizer=optim.Adagrad(lr=0.05), validate_inputs=False)

    def pipeline(m):
        return cachedemb.prefetch(batches, [m], depth=2, horizon=4, overlap=overlap, staging_rows=staging)

    eager, graphed = make(), make()
    eager_out = []
    for ids, _ in pipeline(eager):
        out = eager(ids.cuda(), offsets)
        eager_out.append(out.detach().clone())
        out.square().sum().backward()
    static_ids = torch.empty(lookups, dtype=torch.int64, device="cuda")
    graph, static_out, graphed_out = torch.cuda.CUDAGraph(), None, []
    loop = pipeline(graphed)
    for i, (ids, _) in enumerate(loop):
        static_ids.copy_(ids)
        if i < 4:  # warm-up: every kernel variant of an in-window step compiled; the last on a side stream
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side if i == 3 else torch.cuda.current_stream()):
                out = graphed(static_ids, offsets)
                graphed_out.append(out.detach().clone())
                out.square().sum().backward()
            torch.cuda.current_stream().wait_stream(side)
            continue
        if i == 4:
            assert graphed.cache._window_active  # the captured step is a window batch's
            with loop.paused(), torch.cuda.graph(graph):
                static_out = graphed(static_ids, offsets)
                static_out.square().sum().backward()
        graph.replay()
        graphed_out.append(static_out.detach().clone())
    torch.cuda.synchronize()
    assert len(graphed_out) == len(eager_out) == len(batches)
    for i, (a, b) in enumerate(zip(graphed_out, eager_out)):
        assert torch.equal(a, b), f"batch {i}"
    eager.flush()
    graphed.flush()
    assert torch.equal(graphed.cache.host_weight, eager.cache.host_weight)
    assert graphed.cache_stats()["windows"] == eager.cache_stats()["windows"] > 3


def test_a_bare_cuda_device_is_kept_with_its_index(monkeypatch):
    """`device="cuda"` (or the default) names no GPU while the tensors made on it report cuda:N: the caches keep
    the index, else every `tensor.device == cache.device` silently took its fallback (on the first lent GPU: the
    unvalidated input's repair on the device, the victim pool's mark, the read-ahead's next uses)."""
    from cachedemb.kernels import bag_input

    repairs = []
    real = bag_input.bag_repair_triton
    monkeypatch.setattr(bag_input, "bag_repair_triton", lambda *a, **k: repairs.append(1) or real(*a, **k))
    for device in ("cuda", None):
        emb = cachedemb.CachedEmbeddingBag(1000, 8, mode="sum", cache_rows=100, device=device,
                                           optimizer=optim.SGD(lr=0.1), validate_inputs=False)
        assert emb.cache.device == torch.empty(0, device="cuda").device
        ids, offsets = torch.randint(0, 1000, (64,), device="cuda"), torch.arange(0, 64, 8, device="cuda")
        emb(ids, offsets).sum().backward()
    assert len(repairs) == 2  # each forward's input repaired in one launch on the device


def test_prefetch_on_the_device_read_ahead_equals_the_host_one(monkeypatch):
    """A CUDA cache's pipeline reads ahead on the GPU by default (device_read_ahead.py): the same outputs, table,
    windows and counters as with the host read-ahead (CACHEDEMB_READ_AHEAD=host)."""
    from cachedemb.prefetch import Prefetcher
    from cachedemb.prefetch.device_read_ahead import DeviceReadAhead

    g = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, 4096, 8, device="cuda")
    batches = [(torch.rand(4096, generator=g) ** 3 * 50_000).long() for _ in range(24)]
    runs = []
    for where in ("host", "device"):
        monkeypatch.setenv("CACHEDEMB_READ_AHEAD", where)
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(50_000, 16, mode="sum", cache_rows=6000, device="cuda",
                                           optimizer=optim.Adagrad(lr=0.05), validate_inputs=False)
        pipe = Prefetcher(batches, [emb], depth=2, horizon=8)
        outs = []
        for ids in pipe:
            out = emb(ids.cuda(), offsets)
            outs.append(out.detach().clone())
            out.square().sum().backward()
        assert isinstance(pipe.worker, DeviceReadAhead) == (where == "device")
        emb.flush()
        stats = {k: v for k, v in emb.cache_stats().items() if isinstance(v, int)}
        runs.append((emb.cache.host_weight.clone(), outs, stats, pipe.window_batches))
    (w_h, o_h, s_h, win_h), (w_d, o_d, s_d, win_d) = runs
    assert torch.equal(w_d, w_h) and all(torch.equal(a, b) for a, b in zip(o_d, o_h))
    assert win_d == win_h and sum(win_h) > 0 and s_d == s_h
