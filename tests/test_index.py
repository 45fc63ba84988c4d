"""The id -> slot hash index (kernels/id_index.py) against a Python dict under random insert / delete / lookup
sequences, adversarial ids included; the Triton kernels (under the interpreter) answer every lookup as the dict
does too (their compare-and-swap inserts lay the table out in the order the keys run, so layouts are not
compared); the device-gated rebuild against the reference's."""
import random

import pytest
import torch

from cachedemb.kernels import id_index as X
from conftest import skip_triton_on_cpu_without_interpreter

INTERPRETED = __import__("os").environ.get("TRITON_INTERPRET", "0") == "1"

CAPACITY = 256  # table of 512 positions: wider than MAX_PROBE, so the bound can bite


def adversarial_one_bucket(size: int, count: int) -> list[int]:
    """Ids whose home is the same table position (found by search): the worst case for linear probing."""
    ids = torch.arange(1, 400_000, dtype=torch.int64)
    home = X.mix_torch(ids) & (size - 1)
    return ids[home == home[0]][:count].tolist()


def id_source(kind: str, g: random.Random):
    size = X.index_size(CAPACITY)
    if kind == "random":
        return lambda: g.randint(0, X.MAX_ID - 1)
    if kind == "high_bits":  # multiples of 2^20 (ids are rows < 2^33): equal in every low bit
        return lambda: g.randint(0, (X.MAX_ID >> 20) - 1) << 20
    if kind == "one_bucket":
        pool = adversarial_one_bucket(size, 300)
        return lambda: g.choice(pool)
    raise ValueError(kind)


def run_sequence(backend: str, kind: str, seed: int, steps: int = 40):
    """Random batches of deletes, inserts and lookups, checked against a dict; returns the final table."""
    g = random.Random(seed)
    keys = X.new_index(CAPACITY, "cpu")
    fns = {"torch": (X.index_lookup_torch, X.index_insert_torch, X.index_delete_torch),
           "triton": (X.index_lookup_triton, X.index_insert_triton, X.index_delete_triton)}[backend]
    lookup, insert, delete = fns
    draw = id_source(kind, g)
    model: dict[int, int] = {}
    n_failed = 0
    for step in range(steps):
        early = step % 2 == 0
        gone = g.sample(sorted(model), min(len(model), g.randint(0, 12)))
        batch = gone + [-1, 7 << 40]  # a negative and an absent id are skipped
        delete(keys, torch.tensor(batch), len(batch), early)
        for key in gone:
            del model[key]
        new = set()
        for _ in range(g.randint(0, 24)):
            key = draw()
            if key not in model and len(model) + len(new) < CAPACITY:
                new.add(key)
        new = sorted(new)
        slots = [g.randrange(CAPACITY) for _ in new]
        tail = [-1, 5]  # past n: ignored
        ok = insert(keys, torch.tensor(new + tail, dtype=torch.int64), torch.tensor(slots + [0, 0]),
                    len(new), early)
        assert not ok[len(new):].any()
        for key, slot, placed in zip(new, slots, ok.tolist()):
            if placed:
                model[key] = slot
            else:
                n_failed += 1
        query = list(model) + [draw() for _ in range(16)] + [-3]
        got = lookup(keys, torch.tensor(query), len(query) - 2, not early).tolist()
        want = [model.get(key, -1) for key in query[:-2]] + [-1, -1]
        assert got == want, f"step {step}"
        # No key sits farther than MAX_PROBE from its home, no duplicates.
        live = keys[keys >= 0] >> X.SLOT_BITS
        assert live.unique().numel() == live.numel() == len(model)
    return keys, model, n_failed


@pytest.mark.parametrize("kind", ["random", "high_bits", "one_bucket"])
@pytest.mark.parametrize("seed", [0, 1])
def test_index_matches_dict(kind, seed):
    keys, model, n_failed = run_sequence("torch", kind, seed)
    if kind != "one_bucket":
        assert n_failed == 0  # load <= 1/2 with a good mix: nothing reaches the probe bound
    size = keys.numel()
    pos = torch.arange(size)
    live = keys >= 0
    dist = (pos - (X.mix_torch(keys >> X.SLOT_BITS) & (size - 1))) & (size - 1)
    assert (dist[live] < X.MAX_PROBE).all()  # the probe bound holds, adversarial ids included


def test_one_bucket_batch_is_bounded_by_the_rounds():
    size = X.index_size(CAPACITY)
    bucket = torch.tensor(adversarial_one_bucket(size, X.MAX_PROBE + 40))
    keys = X.new_index(CAPACITY, "cpu")
    ok = X.index_insert_torch(keys, bucket, torch.arange(bucket.numel()), bucket.numel(), True)
    # one id placed per round (all claim the same first free position): the rest are refused this batch
    assert ok.sum() == X.INSERT_ROUNDS
    placed = ok.clone()
    for _ in range(X.MAX_PROBE):  # later batches go on filling the bucket, up to the probe bound
        rest = torch.where(placed, -1, bucket)
        placed |= X.index_insert_torch(keys, rest, torch.arange(bucket.numel()), bucket.numel(), True)
    assert placed.sum() == X.MAX_PROBE
    got = X.index_lookup_torch(keys, bucket, bucket.numel())
    assert torch.equal(got, torch.where(placed, torch.arange(bucket.numel()), -1))


@pytest.mark.parametrize("kind", ["random", "high_bits", "one_bucket"])
def test_triton_index_answers_as_the_reference(kind):
    """run_sequence checks every lookup against the dict; inserts of ids with room in their chain never fail on
    either backend, so both keep the same ids (the one-bucket batches: the compare-and-swap insert places every
    id with a free position within MAX_PROBE, the reference at most one a round)."""
    skip_triton_on_cpu_without_interpreter("triton")
    ref = run_sequence("torch", kind, seed=3, steps=8)
    tri = run_sequence("triton", kind, seed=3, steps=8)
    if kind != "one_bucket":
        assert tri[1] == ref[1] and tri[2] == ref[2] == 0
    else:
        assert tri[2] <= ref[2]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_insert_counts_the_empty_positions_it_claims(backend):
    skip_triton_on_cpu_without_interpreter(backend)
    insert, delete = {"torch": (X.index_insert_torch, X.index_delete_torch),
                      "triton": (X.index_insert_triton, X.index_delete_triton)}[backend]
    g = torch.Generator().manual_seed(1)
    keys = X.new_index(CAPACITY, "cpu")
    used = torch.zeros(1, dtype=torch.int64)
    ids = torch.randperm(10 ** 6, generator=g)[:200]
    insert(keys, ids[:150], torch.arange(150), 150, False, used)
    delete(keys, ids[:60], 60)  # tombstones: later inserts may take them without a new position
    insert(keys, ids[150:], torch.arange(50), 50, False, used)
    assert int(used) == int((keys != X.EMPTY).sum())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_device_rebuild_is_gated_and_clears_tombstones(backend):
    """index_rebuild: nothing while the device flag reads 0; with it set every resident id is laid out afresh (no
    tombstone left) and added to `used`."""
    skip_triton_on_cpu_without_interpreter(backend)
    rebuild = {"torch": X.index_rebuild_torch, "triton": X.index_rebuild_triton}[backend]
    g = torch.Generator().manual_seed(2)
    keys = X.new_index(CAPACITY, "cpu")
    used = torch.zeros(1, dtype=torch.int64)
    slot_ids = torch.full((CAPACITY,), -1, dtype=torch.int64)
    ids = torch.randperm(10 ** 6, generator=g)[:CAPACITY]
    slot_ids[:200] = ids[:200]
    X.index_insert_torch(keys, slot_ids, torch.arange(CAPACITY), CAPACITY, False, used)
    gone = torch.randperm(200, generator=g)[:80]
    X.index_delete_torch(keys, slot_ids[gone], 80)
    slot_ids[gone] = -1
    before = keys.clone()
    rebuild(keys, slot_ids, torch.zeros(1, dtype=torch.int64), used)
    assert torch.equal(keys, before)  # the flag reads 0: untouched
    used.zero_()
    rebuild(keys, slot_ids, torch.ones(1, dtype=torch.int64), used)
    assert not (keys == X.TOMB).any() and int(used) == 120 == int((keys >= 0).sum())
    got = X.index_lookup_torch(keys, ids, CAPACITY)
    assert torch.equal(got, torch.where(slot_ids >= 0, torch.arange(CAPACITY), -1)[: ids.numel()])


@pytest.mark.parametrize("shift", [20, 32, 40])
def test_high_bit_ids_spread(shift):
    size = 1 << 16
    ids = torch.arange(1, 20_001, dtype=torch.int64) << shift
    home = X.mix_torch(ids) & (size - 1)
    assert home.unique().numel() > 0.8 * 20_000 * (1 - 20_000 / (2 * size))


def test_build_equals_lookups_and_clears_tombstones():
    g = torch.Generator().manual_seed(0)
    capacity = 500
    keys = X.new_index(capacity, "cpu")
    ids = torch.randperm(10 ** 6, generator=g)[:capacity]
    ids[::7] = -1  # empty slots
    slots = torch.arange(capacity)
    keys.fill_(X.TOMB)
    ok = X.index_build(keys, ids, slots)
    assert torch.equal(ok, ids >= 0)
    assert not (keys == X.TOMB).any()
    got = X.index_lookup_torch(keys, ids, capacity)
    assert torch.equal(got, torch.where(ids >= 0, slots, -1))


def test_build_wraps_around_the_end():
    size = X.index_size(CAPACITY)
    ids = torch.arange(1, 400_000, dtype=torch.int64)
    home = X.mix_torch(ids) & (size - 1)
    last = ids[home == size - 1][:20]  # a run that must wrap past the last position
    keys = X.new_index(CAPACITY, "cpu")
    ok = X.index_build(keys, last, torch.arange(20))
    assert ok.all()
    assert torch.equal(X.index_lookup_torch(keys, last, 20), torch.arange(20))
    assert (keys[:19] >= 0).all() and keys[size - 1] >= 0  # 1 at the end, 19 wrapped to the front


def test_build_places_far_keys_and_lookups_walk_to_them():
    """A rebuild places every key, however far its chain runs past MAX_PROBE (the bound is on inserts only), and
    lookups walk the chain to its end."""
    size = X.index_size(CAPACITY)
    bucket = torch.tensor(adversarial_one_bucket(size, X.MAX_PROBE + 5))
    keys = X.new_index(CAPACITY, "cpu")
    # capacity is only a size hint for build; pass more ids than rows to overflow one bucket
    ok = X.index_build(keys, bucket, torch.arange(bucket.numel()))
    assert ok.all() and not (keys == X.TOMB).any()
    for lookup in (X.index_lookup_torch, X.index_lookup_triton) if INTERPRETED else (X.index_lookup_torch,):
        for early in (False, True):
            assert torch.equal(lookup(keys, bucket, bucket.numel(), early), torch.arange(bucket.numel()))


@pytest.mark.parametrize("kind", ["random", "one_bucket"])
def test_host_count_paths_equal_the_windowed_reference(kind):
    """With counts on the host (early_exit, CPU) lookups compact the probing ids after every probe, one position
    at a time at first, and inserts scan a key's first position before the rest of its window: the same slots,
    positions, placements and table layout as the windowed path, at high load with tombstones."""
    g = torch.Generator().manual_seed(5)
    capacity = 4096
    size = X.index_size(capacity)
    if kind == "one_bucket":
        pool = torch.tensor(adversarial_one_bucket(size, 60) + torch.randperm(10 ** 7, generator=g)[:6000].tolist())
    else:
        pool = torch.randperm(X.MAX_ID // 1024, generator=g)[:8000] * 1024 + 3
    keys = {early: X.new_index(capacity, "cpu") for early in (True, False)}
    resident = torch.zeros(0, dtype=torch.int64)
    for step in range(12):
        # delete a third of the resident ids, insert new ones up to the capacity (tombstones pile up)
        gone = resident[torch.randperm(resident.numel(), generator=g)[: resident.numel() // 3]]
        fresh = pool[~torch.isin(pool, resident)]
        new = fresh[torch.randperm(fresh.numel(), generator=g)][: capacity - resident.numel() + gone.numel()]
        slots = torch.randint(0, capacity, (new.numel(),), generator=g)
        oks = []
        for early, k in keys.items():
            X.index_delete_torch(k, torch.cat([gone, torch.tensor([-1])]), gone.numel() + 1, early)
            oks.append(X.index_insert_torch(k, new, slots, new.numel(), early))
        assert torch.equal(keys[True], keys[False]), f"step {step}"
        assert torch.equal(oks[0], oks[1])
        resident = torch.cat([resident[~torch.isin(resident, gone)], new[oks[0]]])
        query = torch.cat([resident, pool[:500], torch.tensor([-5])])
        found = [X.index_find_torch(k, query, query.numel() - 1, early) for early, k in keys.items()]
        assert torch.equal(found[0][0], found[1][0]) and torch.equal(found[0][1], found[1][1])
        assert (found[0][1][: resident.numel()] >= 0).all()
    assert (keys[True] == X.TOMB).any()  # the tombstone case was exercised


def test_build_refuses_more_ids_than_positions():
    keys = X.new_index(4, "cpu")
    ids = torch.arange(keys.numel() + 1)
    with pytest.raises(ValueError, match="do not fit"):
        X.index_build(keys, ids, ids)


def test_host_row_index_grows_past_the_rows_it_was_sized_for():
    """The file tier's host index (storage/row_index.RowIndex) is sized for its slab; staging rows (a batch
    larger than the slab) can hold many more ids. It grows instead of filling up (a full index never ends a
    rebuild's probe), and every id stays found."""
    from cachedemb.storage.row_index import RowIndex

    import numpy as np

    index = RowIndex(8)
    live_ids, live_rows = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    rng = np.random.default_rng(0)
    for step in range(6):
        ids = rng.choice(10 ** 9, size=40 * (step + 1), replace=False).astype(np.int64)
        ids = ids[~np.isin(ids, live_ids)]
        rows = np.arange(live_rows.size, live_rows.size + ids.size, dtype=np.int64)
        index.insert(ids, rows, lambda: (live_ids, live_rows))
        live_ids, live_rows = np.concatenate([live_ids, ids]), np.concatenate([live_rows, rows])
        assert np.array_equal(index.lookup(live_ids), live_rows)
    assert index.keys.numel() >= 4 * live_ids.size // 2
