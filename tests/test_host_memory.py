"""Host memory of the CPU cache and the host table: exact size, advised to use transparent huge pages.

A batch's rows sit at random in a cache of tens to hundreds of MB; with 4 KiB pages most row reads and updates
miss the TLB. The advice is
checked in the kernel's own record of the mapping (`VmFlags: hg` in /proc/self/smaps: MADV_HUGEPAGE was applied),
which does not depend on whether THP is enabled on the machine.
"""
import os
import sys

import pytest
import torch

import cachedemb
from cachedemb.cache import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/smaps"),
                                reason="reads the mapping flags from /proc/self/smaps (Linux)")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_empty_is_exact_size_and_advised():
    t = host_memory.host_empty((3, 1 << 20), torch.float32, pinned=False)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 12 << 20  # no rounding up to a power of two
    assert "hg" in vm_flags(t.data_ptr())
    small = host_memory.host_empty((1024,), torch.float32, pinned=False)  # under two huge pages: left alone
    assert "hg" not in vm_flags(small.data_ptr())


def test_unadvised_memory_reads_as_such():
    """The reference the checks here stand against: an anonymous mapping of the same size without the advice
    does not read as advised (so the checks fail where the memory is not advised; torch's own allocator is no
    reference: some builds advise large blocks themselves)."""
    import ctypes
    import mmap

    plain = mmap.mmap(-1, 12 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(plain))
    try:
        assert "hg" not in vm_flags(address)
    finally:
        del address
        plain.close()


@pytest.mark.parametrize("spare_rows", [0, 50_000])
def test_cpu_cache_rows_on_huge_pages(spare_rows):
    """The CPU cache rows (and the buffer they are regrown into for host-served rows) are advised; the table
    trains as the full table does (the rows are copied over when the buffer grows)."""
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(200_000, 64, mode="sum", cache_rows=40_000, device="cpu",
                                       optimizer=cachedemb.optim.SGD(lr=0.1))  # 10 MiB of cache rows
    ref = torch.nn.EmbeddingBag.from_pretrained(emb.weight.detach().clone(), mode="sum", freeze=False,
                                                sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert "hg" in vm_flags(emb.cache.rows.data_ptr())
    if spare_rows:
        emb.cache._reserve_spare(spare_rows)
        assert emb.cache.rows_spare.shape[0] >= 40_000 + spare_rows
        assert "hg" in vm_flags(emb.cache.rows.data_ptr())
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 200_000, (2048,), generator=g)
        offsets = torch.arange(0, 2048, 8)
        emb(ids, offsets).square().sum().backward()
        opt.zero_grad()
        ref(ids, offsets).square().sum().backward()
        opt.step()
    torch.testing.assert_close(emb.weight.detach(), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_read_ahead_map_on_huge_pages():
    """The read-ahead's id map and its per-position arrays (random probes over tens of MB at a real horizon)
    are advised once they are large enough; its answers are checked against brute force elsewhere
    (tests/test_prefetch_readahead.py), here only that the same entries come back."""
    from cachedemb.prefetch.next_use import NextUseTracker
    tracker = NextUseTracker(None, 8)
    ids = torch.randperm(1 << 22)[:300_000]
    tracker.enter(0, ids.sort().values)
    m = tracker.map
    assert m.keys.numel() * 8 >= 4 << 20
    for t in (m.keys, m.words):  # (the pinned flags, a byte a position, stay under two huge pages)
        assert "hg" in vm_flags(t.data_ptr())
    uses = tracker.slot_uses(ids[:50_000], 0, 8)
    assert torch.equal(uses, torch.zeros(50_000, dtype=torch.int64))  # every id is used in batch 0
    assert "hg" in vm_flags(tracker._slot_at.data_ptr())
    absent = tracker.first_use(torch.arange(1 << 22, (1 << 22) + 10), 0, 8)
    assert torch.equal(absent, torch.full((10,), -1, dtype=torch.int64))
