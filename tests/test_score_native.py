"""The built-in policies' slot scores in C (cachedemb/cache/score_native.c) equal the policies' torch code bit for
bit: every slot or a subset, empty and protected slots, counts and uses past the caps, no next use and next uses
past the horizon tier; a user's policy and a multi-table cache are left to the policy."""
from __future__ import annotations

import pytest
import torch

from cachedemb.cache import score_native
from cachedemb.cache.policy import SlotView, lfu, lookahead, lru

pytestmark = pytest.mark.skipif(score_native.NATIVE.get() is None, reason="no C compiler: the policies' torch code runs")


def metadata(c, seed):
    g = torch.Generator().manual_seed(seed)
    slot_ids = torch.randint(-1, 50, (c + 1,), generator=g)
    freq = torch.randint(0, 100, (c + 1,), generator=g)
    freq[:3] = torch.tensor([(1 << 24) + 5, (1 << 33) + 1, 1 << 62])  # past the lookahead's and the tier's caps
    last_use = torch.randint(0, 1000, (c + 1,), generator=g)
    last_use[3] = (1 << 34)
    next_use = torch.randint(-1, 20, (c,), generator=g)
    next_use[4] = (1 << 33)  # past the tier
    protected = torch.rand(c, generator=g) < 0.2
    return slot_ids, freq, last_use, next_use, protected


@pytest.mark.parametrize("policy", [lfu, lru, lookahead])
@pytest.mark.parametrize("subset", [False, True])
def test_c_scores_equal_the_policy(policy, subset):
    c = 97
    slot_ids, freq, last_use, next_use, protected = metadata(c, 1)
    if subset:
        slots = torch.randperm(c)[:40]
        view = SlotView(slot_ids[slots], freq[slots], last_use[slots], next_use[slots], protected[slots], None,
                        slots, c)
        got = score_native.score(policy, slots, protected[slots], c, slot_ids, freq, last_use, next_use)
    else:
        view = SlotView(slot_ids[:c], freq[:c], last_use[:c], next_use, protected)
        got = score_native.score(policy, None, protected, c, slot_ids, freq, last_use, next_use)
    assert got is not None
    assert torch.equal(got, policy(view))


def test_a_user_policy_is_left_to_its_own_code():
    def mine(view):
        return lfu(view)

    slot_ids, freq, last_use, next_use, protected = metadata(10, 2)
    assert score_native.score(mine, None, protected, 10, slot_ids, freq, last_use, next_use) is None


def test_c_next_uses_equal_the_torch_code():
    g = torch.Generator().manual_seed(5)
    c = 200
    slot_ids = torch.randint(-1, 30, (c + 1,), generator=g)
    ids = torch.where(torch.rand(c, generator=g) < 0.8, slot_ids[:c], torch.randint(-1, 30, (c,), generator=g))
    uses = torch.randint(-1, 50, (c,), generator=g)  # batches to the next use, -1: none
    known = (slot_ids[:c] == ids) & (uses >= 0)
    assert torch.equal(score_native.next_use(slot_ids, ids, uses),
                       torch.where(known, uses, torch.full_like(uses, -1)))


def test_the_c_kinds_are_the_slot_score_kernel_kinds():
    """score_native.c numbers the policies as kernels/slot_score.py does (the mapping is policy.score_kernel)."""
    from cachedemb import kernels

    assert (kernels.SCORE_LFU, kernels.SCORE_LRU, kernels.SCORE_LOOKAHEAD) == (0, 1, 2)


@pytest.mark.parametrize("policy", [lfu, lru, lookahead])
def test_the_pools_c_rescoring_scores_as_the_policy(policy):
    """pool_native.rescore shares the score with score_native.c (slot_score.h): the same scores past the caps."""
    from cachedemb.cache import pool_native

    c = 97
    slot_ids, freq, last_use, next_use, protected = metadata(c, 2)
    pool = torch.randperm(c)[:60]
    got = pool_native.rescore(score_native.kind(policy), pool, torch.arange(c), c, slot_ids, freq, last_use,
                              next_use, protected, 0, torch.zeros(c, dtype=torch.bool))
    union = torch.cat([pool, torch.tensor(sorted(set(range(c)) - set(pool.tolist())), dtype=torch.int64)])
    assert torch.equal(got.union, union)
    view = SlotView(slot_ids[union], freq[union], last_use[union], next_use[union], protected[union], None, union, c)
    assert torch.equal(got.score, policy(view))

