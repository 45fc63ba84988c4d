"""kernels.bag_input: unvalidated bag input repaired on the device in one launch, against its torch reference (the
module's former torch ops): offsets clamped and made non-decreasing with phantom bags at either end, ids out of
range or outside every bag made padding, both counted."""
import os

import pytest
import torch

from cachedemb.kernels.bag_input import bag_repair_torch, bag_repair_triton, full_offsets_size

if os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"

CASES = {
    # name: (ids, offsets or None (2-D: width), trail, extend_last, pad_id)
    "clean": (100, [0, 10, 30, 30, 99], False, False, -1),
    "bad_offsets": (100, [5, 3, 120, 40, -2, 100], False, False, -1),
    "trail": (100, [2, 50, 70, 60], True, False, 7),
    "extend_last": (100, [0, 20, 90, 40], False, True, 3),
    "no_offsets": (20, [], False, False, -1),
    "no_ids": (0, [0, 0], False, False, -1),
    "multi_scan": (50_000, list(range(0, 50_000, 13)) + [7, 49_999], True, False, -1),
    "two_d": (96, 8, False, False, -1),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_bag_repair_equals_reference(name, dtype):
    n, offs, trail, extend_last, pad_id = CASES[name]
    g = torch.Generator().manual_seed(n)
    num_embeddings = 1000
    ids = torch.randint(-50, num_embeddings + 50, (n,), generator=g).to(dtype)
    two_d = isinstance(offs, int)
    offsets = None if two_d else torch.tensor(offs, dtype=dtype)
    width = offs if two_d else 0
    size = full_offsets_size(0 if two_d else len(offs), n // width if two_d else None, extend_last)
    outs = []
    for fn in (bag_repair_torch, bag_repair_triton):
        invalid = torch.tensor([3, 4], device=DEVICE)
        out_ids = torch.empty(n, dtype=torch.int64, device=DEVICE)
        out_full = torch.empty(size, dtype=torch.int64, device=DEVICE)
        fn(ids.to(DEVICE), None if offsets is None else offsets.to(DEVICE), num_embeddings, pad_id, width, trail,
           extend_last, invalid, out_ids, out_full)
        outs.append((out_ids, out_full, invalid))
    for what, a, b in zip(("ids", "full", "invalid"), *outs):
        assert torch.equal(a.cpu(), b.cpu()), what
    if name not in ("no_offsets", "no_ids"):
        assert int(outs[0][2][0]) > 3  # some ids were out of range
