"""storage/record_copy.py: a table record's fields to and from the host rows in one C pass, against the torch
code it replaces (format.RecordLayout's `pack` and views), and file-backed training through either path."""
import pytest
import torch

import cachedemb
from cachedemb.storage import record_copy
from cachedemb.storage.format import RecordLayout
from cachedemb.storage.record_copy import RecordFields


def needs_c():
    layout = RecordLayout(3, torch.float32, (), torch.float32)
    if RecordFields.of(layout, torch.zeros(1, 3), {}, torch.zeros(1, dtype=torch.int64)) is None:
        pytest.skip("C helpers off: the torch code runs")


@pytest.mark.parametrize("dtype,state_cols", [
    (torch.float32, ()),
    (torch.float32, (("sum", 5, 0.0),)),
    (torch.float16, (("exp_avg", 3, 0.0), ("exp_avg_sq", 3, 0.0))),
    (torch.float64, (("momentum", 7, 0.0), ("step", 1, 0.0))),
])
def test_pack_and_land_equal_the_layouts_torch_code(dtype, state_cols):
    needs_c()
    g = torch.Generator().manual_seed(len(state_cols))
    n, dim = 50, 7
    state_dtype = torch.float32 if dtype != torch.float64 else torch.float64
    layout = RecordLayout(dim, dtype, state_cols, state_dtype)
    weight = torch.randn(n, dim, generator=g).to(dtype)
    states = {name: torch.randn(n, cols, generator=g).to(state_dtype) for name, cols, _ in state_cols}
    counts = torch.randint(0, 1 << 40, (n,), generator=g)
    fields = RecordFields.of(layout, weight, states, counts)
    rows = torch.randperm(n, generator=g)[:20]
    expected = layout.pack(weight[rows], {k: v[rows] for k, v in states.items()}, counts[rows])
    got = fields.pack(rows)
    assert torch.equal(got, expected)  # every byte, padding zero

    # land into other rows (and through an order, as the reader threads do): each field lands where the views say
    target = (torch.zeros_like(weight), {k: torch.zeros_like(v) for k, v in states.items()}, torch.zeros_like(counts))
    into = RecordFields.of(layout, *target)
    dest = torch.randperm(n, generator=g)[:20]
    order = torch.randperm(20, generator=g)
    into.land(expected, dest, order)
    at = dest[order]
    assert torch.equal(target[0][at], layout.weight_view(expected))
    for name in states:
        assert torch.equal(target[1][name][at], layout.state_view(expected, name))
    assert torch.equal(target[2][at], layout.count_view(expected))
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[at] = False
    assert not target[0][untouched].any() and not target[2][untouched].any()
    with pytest.raises(IndexError, match="rows must lie"):
        into.land(expected, torch.full((20,), n), None)


def test_declines_what_it_cannot_copy():
    layout = RecordLayout(4, torch.float32, (("sum", 4, 0.0),), torch.float32)
    w, s, c = torch.zeros(6, 4), {"sum": torch.zeros(6, 4)}, torch.zeros(6, dtype=torch.int64)
    needs_c()
    assert RecordFields.of(layout, w, s, c) is not None
    assert RecordFields.of(layout, torch.zeros(4, 6).t(), s, c) is None  # rows not contiguous
    assert RecordFields.of(layout, w, {}, c) is None  # a state missing
    assert RecordFields.of(layout, w.double(), s, c) is None  # another dtype


@pytest.mark.parametrize("spec", [cachedemb.optim.SGD(lr=0.1), cachedemb.optim.Adam(lr=0.01)],
                         ids=["sgd", "adam"])
def test_file_backed_training_is_the_same_through_either_path(spec, tmp_path, monkeypatch):
    """Loads (reader threads), write-backs and rows served from in-flight writes through the C pass and through
    the torch code: the same table, the same file records."""
    def train(c_pass: bool, name: str):
        monkeypatch.setattr(record_copy.NATIVE, "enabled", c_pass)
        torch.manual_seed(0)
        emb = cachedemb.CachedEmbeddingBag(3000, 4, mode="sum", cache_rows=60, device="cpu", optimizer=spec,
                                           storage=cachedemb.FileStorage(tmp_path / name, host_cache_bytes=30_000))
        g = torch.Generator().manual_seed(5)
        for _ in range(25):
            ids = (torch.rand(96, generator=g) ** 2 * 3000).long()
            emb(ids, torch.arange(0, 96, 6)).sum().backward()
        assert (emb.host._fields() is not None) == (c_pass and record_copy.NATIVE.get() is not None)
        out = emb.export_state_dict()
        stats = dict(emb.host.stats)
        emb.close()
        return out, stats

    (a, stats_a), (b, stats_b) = train(True, "c.cemb"), train(False, "t.cemb")
    assert stats_a["evicted"] > 0 and stats_a["written_back"] > 0
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
