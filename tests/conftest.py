"""Test setup: Triton runs under its interpreter on CPU (must be set before triton is first imported), and
fresh `torch.empty` buffers are poisoned with NaN so a kernel that reads memory nobody wrote fails loudly."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

_real_empty = torch.empty


def _nan_empty(*args, **kwargs):
    t = _real_empty(*args, **kwargs)
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.int64, torch.int32):
        t.fill_(-(2**30) + 7)
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _nan_empty)
    yield


def has_cuda() -> bool:
    return torch.cuda.is_available()


def devices():
    return ["cpu"] + (["cuda"] if has_cuda() else [])
