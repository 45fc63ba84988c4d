"""Collections with their tables on file (`CachedEmbeddingBagCollection(..., storage=FileStorage(dir, bytes))`):
each table in `<dir>/<table>.cemb`, initialized with torchrec's draws (streamed), trains exactly as the in-memory
collection, with and without prefetch; state_dict names snapshots; export streams the rows."""
from __future__ import annotations

import pytest
import torch

import cachedemb
from cachedemb import TableConfig, optim

pytestmark = [pytest.mark.usefixtures("sizing_mode", "write_mode")]

TABLES = [TableConfig("users", 300, 8, ["u"]), TableConfig("goods", 200, 8, ["i", "j"]),
          TableConfig("ads", 120, 4, ["a"], pooling="mean")]


def batches(steps=10, batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        feats = {}
        for name, rows in (("u", 300), ("i", 200), ("j", 200), ("a", 120)):
            lengths = torch.randint(0, 4, (batch,), generator=g)
            ids = (torch.rand(int(lengths.sum()), generator=g) ** 2 * rows).long()
            feats[name] = (ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
        out.append(feats)
    return out


def build(tmp_path=None, host=6000):
    torch.manual_seed(0)
    storage = cachedemb.FileStorage(tmp_path, host_cache_bytes=host) if tmp_path is not None else None
    return cachedemb.CachedEmbeddingBagCollection(TABLES, cache_rows=8, optimizer=optim.Adagrad(lr=0.1),
                                                  device="cpu", storage=storage)


def step(ebc, feats):
    out = ebc(feats)
    sum((torch.tanh(v) * (k + 1)).sum() for k, v in enumerate(out.values())).backward()
    return out


def assert_same(ref, ours):
    want, got = ref.to_embedding_bag_collection(), ours.to_embedding_bag_collection()
    for t in TABLES:
        assert torch.equal(want.embedding_bags[t.name].weight, got.embedding_bags[t.name].weight), t.name


@pytest.mark.parametrize("prefetch", [False, True])
def test_collection_on_file_trains_as_in_memory(tmp_path, prefetch):
    pytest.importorskip("torchrec")
    ref, ours = build(), build(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ads.cemb", "goods.cemb", "users.cemb"]
    assert_same(ref, ours)  # torchrec's init draws, streamed into the files
    data = batches()
    source = cachedemb.prefetch(data, [ours], depth=2, horizon=3) if prefetch else data
    for feats, b in zip(data, source):
        want, got = step(ref, feats), step(ours, b)
        assert all(torch.equal(want[k], got[k]) for k in want)
    assert_same(ref, ours)
    stats = ours.cache_stats()
    assert stats["host_cache"]["evicted"] > 0 and stats["file"]["rows_read"] > 0
    sd = ours.state_dict()
    assert "embedding_bags.users.storage.snapshot" in sd and "embedding_bags.users.weight" not in sd
    ours.close()


def test_collection_reopens_and_loads_its_snapshot(tmp_path):
    pytest.importorskip("torchrec")
    ref, ours = build(), build(tmp_path)
    data = batches(steps=12, seed=1)
    for feats in data[:6]:
        step(ref, feats), step(ours, feats)
    sd = ours.state_dict()
    for feats in data[6:9]:
        step(ours, feats)
    ours.close()
    again = build(tmp_path)  # the files exist: opened, not drawn again
    again.load_state_dict(sd)
    for feats in data[6:]:
        want, got = step(ref, feats), step(again, feats)
        assert all(torch.equal(want[k], got[k]) for k in want)
    assert_same(ref, again)
    with pytest.raises(ValueError, match="is on file"):
        again.embedding_bags["users"].weight
    again.close()
