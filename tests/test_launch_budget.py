"""The launch budget: a steady-state training step (sync-free sizing, Triton backend, `validate_inputs=False`,
one table, fused Adagrad, 200k rows, a 4k-row cache) issues at most 60 device launches (Triton kernels + aten
ops, cachedemb/tools/launch_count.py), with or without the prefetch pipeline, and the count does not grow with
the batch, the horizon or the number of windows. With prefetch the count is averaged over whole windows: window
admission happens once per `depth` batches. Counted under Triton's CPU interpreter (on a GPU the same code
launches the same kernels)."""
import os

import pytest

from cachedemb.tools.launch_count import measure_step

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="counts Triton launches on CPU tensors: needs TRITON_INTERPRET=1")

BUDGET = 60
_RESULTS: dict = {}


def counted(bags: int, prefetch=None, steps: int = 2) -> dict:
    key = (bags, prefetch, steps)
    if key not in _RESULTS:
        _RESULTS[key] = measure_step(bags=bags, prefetch=prefetch, steps=steps, warmup=4)
    return _RESULTS[key]


def test_step_within_budget():
    r = counted(64)
    assert r["launches"] <= BUDGET, r


def test_prefetch_step_within_budget():
    r = counted(64, prefetch=(2, 8), steps=4)
    assert r["launches"] <= BUDGET, r


@pytest.mark.parametrize("prefetch", [None, (2, 8)], ids=["plain", "prefetch"])
def test_launches_do_not_grow_with_the_batch(prefetch):
    steps = 2 if prefetch is None else 4
    small, large = counted(64, prefetch, steps), counted(1024, prefetch, steps)
    assert large["launches"] <= small["launches"], (small["top_sites"], large["top_sites"])


def test_launches_do_not_grow_with_horizon_or_windows():
    base = counted(64, prefetch=(2, 8), steps=4)
    longer = counted(64, prefetch=(2, 16), steps=4)
    more_windows = counted(64, prefetch=(2, 8), steps=8)
    assert longer["launches"] <= base["launches"], (base["top_sites"], longer["top_sites"])
    assert more_windows["launches"] <= base["launches"], (base["top_sites"], more_windows["top_sites"])
