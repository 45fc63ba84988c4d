"""Test setup: without CUDA, Triton runs under its interpreter (set before triton is first imported; importing
torch does not import triton), and fresh `torch.empty` buffers are poisoned with NaN so a kernel that reads
memory nobody wrote fails loudly."""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


# torchrec is optional (pyproject has no dependency on it): tests that feed a KeyedJaggedTensor or compare with
# torchrec's modules skip without it; the rest of their files still runs.
HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None
needs_torchrec = pytest.mark.skipif(not HAS_TORCHREC, reason="needs torchrec (optional)")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def devices():
    return ["cpu"] + (["cuda"] if has_cuda() else [])


@pytest.fixture(params=["c", "python"])
def io_loop(request, monkeypatch):
    """A table-file suite with the span loop in C (rowio.c, where the C library is installed) and in Python
    (os.preadv / os.pwritev)."""
    from cachedemb.storage import rowio

    if request.param == "python":
        monkeypatch.setattr(rowio.NATIVE, "enabled", False)
    elif rowio.backend() != "c":
        pytest.skip("the C library is not installed (or CACHEDEMB_NATIVE=0): the Python span loop runs")
    return request.param


@pytest.fixture(params=["in_place", "log"])
def write_mode(request, monkeypatch):
    """Run a storage suite with table files written in place and as logs (CACHEDEMB_STORAGE_LOG, which spawned
    processes inherit, decides FileStorage(log=None))."""
    monkeypatch.setenv("CACHEDEMB_STORAGE_LOG", "1" if request.param == "log" else "0")
    return request.param


@pytest.fixture(params=["exact", "sync_free"])
def sizing_mode(request, monkeypatch):
    """Run a suite under both sizing rules: `exact` (CPU reads counts on the host) and `sync_free`
    (CACHEDEMB_SYNC_FREE=1: CPU tensors take the CUDA path's static bounds and device-side counts)."""
    if request.param == "sync_free":
        monkeypatch.setenv("CACHEDEMB_SYNC_FREE", "1")
    else:
        monkeypatch.delenv("CACHEDEMB_SYNC_FREE", raising=False)
    return request.param


def pytest_configure(config):
    """In CI (CI=true) the C helpers must be installed: without them every C-vs-reference test would skip and
    the suite pass with the C paths untested. CACHEDEMB_NATIVE=0, set explicitly, runs the pure paths only."""
    from cachedemb.kernels import native

    if os.environ.get("CI", "").lower() in ("1", "true") and os.environ.get("CACHEDEMB_NATIVE") != "0" \
            and not native.native_available():
        raise pytest.UsageError(f"CI=true but the C helpers are not available ({native.status()}); install with a "
                                "C compiler (CACHEDEMB_REQUIRE_NATIVE=1 makes the build fail without one), or set "
                                "CACHEDEMB_NATIVE=0 to test the pure paths only")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run tests marked slow (soak, long spawned jobs); `scripts/test.sh --slow`")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with --slow: CI runs the fast suite, a release check runs everything."""
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with scripts/test.sh --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def skip_triton_on_cpu_without_interpreter(backend: str) -> None:
    """Tests that run the Triton backend on CPU tensors need the interpreter; on a CUDA machine
    (TRITON_INTERPRET=0, scripts/gpu_suite.sh) the kernels' CUDA cases run in tests/kernels and test_gpu."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")
