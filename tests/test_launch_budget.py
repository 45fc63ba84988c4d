"""The launch budget: a steady-state training step (sync-free sizing, Triton backend, `validate_inputs=False`,
one table, fused Adagrad, 200k rows, a 4k-row cache) issues at most 60 device launches (Triton kernels + aten
ops, cachedemb/tools/launch_count.py), with or without the prefetch pipeline, and the count does not grow with
the batch, the horizon or the number of windows. With prefetch the count is averaged over whole windows: window
admission happens once per `depth` batches; the pipeline's host read-ahead (over the loader's host ids) is host
work, reported apart. Counted under Triton's CPU interpreter without running the kernels (the interpreter takes
about a minute a step at 64 x 26): valid in the sync-free mode, where no host decision reads a device value, and
checked here against runs that execute every kernel."""
import os

import pytest

from cachedemb.tools.launch_count import measure_step

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="counts Triton launches on CPU tensors: needs TRITON_INTERPRET=1")

BUDGET = 60
_RESULTS: dict = {}


def counted(bags: int, prefetch=None, steps: int = 4, **kwargs) -> dict:
    key = (bags, prefetch, steps, tuple(sorted(kwargs.items())))
    if key not in _RESULTS:
        _RESULTS[key] = measure_step(bags=bags, prefetch=prefetch, steps=steps, warmup=4, execute=False, **kwargs)
    return _RESULTS[key]


@pytest.mark.parametrize("prefetch", [None, (1, 4)], ids=["plain", "prefetch"])
def test_counting_without_running_the_kernels_is_faithful(prefetch):
    """The same counts, op by op, as a run that executes every kernel (a small shape: the interpreter is slow)."""
    shape = dict(bags=8, num_rows=5000, cache_rows=200, prefetch=prefetch, steps=2, warmup=2)
    ran = measure_step(execute=True, **shape)
    dry = measure_step(execute=False, **shape)
    assert ran["launches"] == dry["launches"] and ran["top_ops"] == dry["top_ops"], (ran["top_ops"], dry["top_ops"])
    assert ran["launches"] <= BUDGET


def test_step_within_budget():
    r = counted(64)
    assert r["launches"] <= BUDGET, r["top_sites"]


@pytest.mark.parametrize("prefetch", [(1, 4), (2, 8), (4, 16)], ids=lambda p: f"depth{p[0]}-horizon{p[1]}")
def test_prefetch_step_within_budget(prefetch):
    r = counted(64, prefetch=prefetch, steps=8)
    assert r["launches"] <= BUDGET, r["top_sites"]
    assert r["host_pipeline_ops"] > 0  # the read-ahead was counted, apart


def test_launches_do_not_grow_with_the_batch():
    base = counted(64)
    for bags in (256, 1024):
        larger = counted(bags)
        assert larger["launches"] <= base["launches"], (bags, base["top_sites"], larger["top_sites"])


def test_prefetch_launches_do_not_grow_with_the_batch():
    """Through the pipeline, with the cache scaled with the batch so that windows of the same depth fit (a window
    that does not fit shrinks to fewer batches: more admissions per step, whatever the batch size)."""
    base = counted(64, (2, 8), steps=8)
    for bags in (256, 1024):
        larger = counted(bags, (2, 8), steps=8, cache_rows=4000 * bags // 64)
        assert larger["launches"] <= base["launches"], (bags, base["top_sites"], larger["top_sites"])
    assert counted(256, (2, 8), steps=8)["launches"] <= BUDGET  # the same cache: 1-batch windows, still in budget


def test_launches_do_not_grow_with_horizon_or_windows():
    base = counted(64, prefetch=(2, 8), steps=8)
    longer = counted(64, prefetch=(2, 32), steps=8)
    more_windows = counted(64, prefetch=(2, 8), steps=24)
    assert longer["launches"] <= base["launches"], (base["top_sites"], longer["top_sites"])
    assert more_windows["launches"] <= base["launches"], (base["top_sites"], more_windows["top_sites"])
