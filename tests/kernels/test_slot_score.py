"""The gated full ranking (kernels/slot_score.py and victim_select's gate) against the torch references.

Scores equal the policy functions of cachedemb/cache/policy.py bit for bit over adversarial slot metadata (empty and
protected slots, counts past every cap, next uses past the horizon, many tables); a gate reading 0 makes the
kernels store nothing (a poisoned output stays poisoned) and the selection return valid indices, a gate reading 1
gives the reference's slots. Runs under the interpreter on CPU, on the GPU with TRITON_INTERPRET=0.
"""
import os

import pytest
import torch

from cachedemb.kernels import PROTECTED
from cachedemb.kernels.slot_score import SCORE_LFU, slot_score_triton
from cachedemb.kernels.victim_select import victim_select_torch, victim_select_triton
from cachedemb.cache.policy import POLICIES, SlotView, score_kernel

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"


def metadata(C: int, seed: int, num_rows: int = 10_000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (C,), generator=g)
    ids[torch.rand(C, generator=g) < 0.15] = -1  # empty slots
    freq = torch.randint(0, 40, (C,), generator=g)
    freq[torch.rand(C, generator=g) < 0.05] = 1 << 34  # past lfu's and lookahead's caps
    last = torch.randint(0, 1000, (C,), generator=g)
    last[torch.rand(C, generator=g) < 0.05] = (1 << 33) + 5  # past lru's cap
    nxt = torch.randint(-1, 64, (C,), generator=g)
    nxt[torch.rand(C, generator=g) < 0.05] = 1 << 40  # past the look-ahead tier
    protected = torch.rand(C, generator=g) < 0.2
    return [t.to(DEVICE) for t in (ids, freq, last, nxt)] + [protected.to(DEVICE)]


def table_ranks(starts: torch.Tensor, num_rows: int):
    sizes = torch.diff(starts, append=torch.tensor([num_rows]))
    order = torch.argsort(-sizes, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return rank


def reference(name, ids, freq, last, nxt, protected, tables=None):
    rank = None
    if tables is not None:
        starts, ranks = tables
        rank = ranks[torch.searchsorted(starts, ids.clamp(min=0), right=True) - 1]
    return POLICIES[name](SlotView(ids, freq, last, nxt, protected, rank))


@pytest.mark.parametrize("name", ["lfu", "lru", "lookahead"])
@pytest.mark.parametrize("C", [1, 17, 5000])
def test_scores_equal_the_policy(name, C):
    fields = metadata(C, seed=C)
    out = slot_score_triton(score_kernel(POLICIES[name]), *fields)
    assert torch.equal(out, reference(name, *fields))


@pytest.mark.parametrize("n_tables", [1, 2, 3, 26, 257])
def test_lookahead_reads_the_table_rank_as_searchsorted(n_tables):
    num_rows = 10_000
    g = torch.Generator().manual_seed(n_tables)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64),
                        torch.randperm(num_rows - 1, generator=g)[: n_tables - 1].sort().values + 1])
    tables = (starts.to(DEVICE), table_ranks(starts, num_rows).to(DEVICE))
    fields = metadata(3000, seed=n_tables, num_rows=num_rows)
    fields[3][:] = -1  # no next use: every score is by count and table rank
    out = slot_score_triton(score_kernel(POLICIES["lookahead"]), *fields, tables=tables)
    assert torch.equal(out, reference("lookahead", *fields, tables=tables))


def test_a_closed_gate_stores_nothing():
    fields = metadata(3000, seed=1)
    poison = torch.full((3000,), -12345, dtype=torch.int64, device=DEVICE)
    out = slot_score_triton(SCORE_LFU, *fields, gate=torch.zeros(1, dtype=torch.bool, device=DEVICE),
                            out=poison.clone())
    assert torch.equal(out, poison)
    out = slot_score_triton(SCORE_LFU, *fields, gate=torch.ones(1, dtype=torch.bool, device=DEVICE),
                            out=poison.clone())
    assert torch.equal(out, reference("lfu", *fields))


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="7"):
        slot_score_triton(7, *metadata(4, seed=0))


def test_custom_policies_have_no_kernel():
    lfu = POLICIES["lfu"]

    def wrapped(view):
        return lfu(view)

    assert score_kernel(lfu) is not None and score_kernel(wrapped) is None


@pytest.mark.parametrize("C, k", [(1, 1), (700, 33), (20_000, 4000)])
def test_victim_select_gate(C, k):
    g = torch.Generator().manual_seed(C)
    score = (torch.randperm(10 * C, generator=g)[:C] - 3 * C).to(DEVICE)
    score[: C // 4] = PROTECTED
    closed = victim_select_triton(score, k, gate=torch.zeros(1, dtype=torch.bool, device=DEVICE))
    assert closed.shape == (k,) and bool(((closed >= 0) & (closed < C)).all())
    opened = victim_select_triton(score, k, gate=torch.ones(1, dtype=torch.bool, device=DEVICE))
    assert torch.equal(opened, victim_select_torch(score, k))
