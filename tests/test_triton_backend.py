"""The module suites once more with every op forced onto its Triton kernel (the interpreter on CPU), on a reduced
parametrization that still covers each mode, input form, padding, per-sample weights, spill and optimizer."""
import os

import pytest
import torch

import test_conformance as conformance
import test_training as training


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="forces Triton onto CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def cuda_path(monkeypatch):
    """The CUDA path on CPU: Triton kernels (under the interpreter) with the sync-free sizing rules."""
    monkeypatch.setenv("CACHEDEMB_BACKEND", "triton")
    monkeypatch.setenv("CACHEDEMB_SYNC_FREE", "1")


def _pick():
    """One case per (mode, flag) so every input form is covered at least once, dims 1 and 60 / 7 and 129."""
    chosen, seen = [], set()
    for case in conformance.CASES:
        key = (case["mode"], case["two_d"], case["psw"], case["padding"], case["dim"] in (1, 60))
        if key not in seen:
            seen.add(key)
            chosen.append(case)
    return chosen


@pytest.mark.parametrize("case", _pick(), ids=conformance.case_id)
def test_conformance_on_triton(case):
    conformance.test_matches_nn_embedding_bag(case)


@pytest.mark.parametrize("name,mode", [("sgd", "sum"), ("adagrad", "mean"), ("rowwise_adagrad", "max"),
                                       ("adam", "sum")])
def test_training_on_triton(name, mode, monkeypatch):
    monkeypatch.setattr(training, "STEPS", 8)  # each step still evicts (20-row cache)
    training.test_cached_training_equals_full_table(name, mode)


@pytest.mark.slow  # host-served misses on Triton are also trained in test_dropin / test_training_on_triton
def test_spill_training_on_triton():
    training.test_spill_path_trains_exactly()


def test_the_triton_path_really_runs(monkeypatch):
    import sys

    pf = sys.modules["cachedemb.kernels.pooled_forward"]

    calls = []
    real = pf.pooled_forward_triton
    monkeypatch.setattr(pf, "pooled_forward_triton", lambda *a: calls.append(1) or real(*a))
    emb = conformance.make_pair(20, 4, "sum", 3)[1]
    emb(torch.tensor([1, 2, 3]), torch.tensor([0]))
    assert calls


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_only_batch_on_triton(mode):
    conformance.test_a_batch_of_only_padding(mode, fused=True)
